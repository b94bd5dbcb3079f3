// ring_common.cpp: the communicator, the collective check and plan, block options and the
// travelling key/value shards (ring_internal.hpp).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "attend/error.hpp"
#include "mpi/ring_internal.hpp"
#include "score_rule_layer.hpp"
#include "score_rules.hpp"

namespace attend::mpi {

std::vector<ShardPiece> shard_pieces(ShardLayout layout, int64_t length, int ranks, int rank) {
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    throw Error("shard_pieces: rank " + std::to_string(rank) + " of " + std::to_string(ranks) +
                " ranks does not exist");
  }
  if (length < 0) throw Error("shard_pieces: negative length " + std::to_string(length));
  if (layout == ShardLayout::kContiguous) {
    const int64_t base = length / ranks, extra = length % ranks;
    const int64_t offset = rank * base + std::min<int64_t>(rank, extra);
    return {ShardPiece{offset, base + (rank < extra ? 1 : 0)}};
  }
  if (length % (2 * ranks) != 0) {
    throw Error("the zigzag layout cuts the sequence into 2 x " + std::to_string(ranks) +
                " equal chunks: the length " + std::to_string(length) + " is not a multiple of " +
                std::to_string(2 * ranks));
  }
  const int64_t chunk = length / (2 * ranks);
  return {ShardPiece{rank * chunk, chunk}, ShardPiece{(2 * ranks - 1 - rank) * chunk, chunk}};
}

}  // namespace attend::mpi

namespace attend::mpi::detail {

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char message[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(rc, message, &length);
  throw Error(std::string(what) + " failed: " + std::string(message, static_cast<size_t>(length)));
}

namespace {

// What rank r brings to the collective check: its sizes and options as integers (doubles by
// their bits), and its own error, if any.
constexpr int kFields = 40;
constexpr int kMessageBytes = 400;
struct Signature {
  int64_t failed = 0;
  int64_t field[kFields] = {};
  char message[kMessageBytes] = {};
};

// The fields every signature starts with, at fixed places; the options follow (Fields).
enum Field : int {
  kRank,
  kBatch0,
  kBatch1,
  kBatch2,
  kBatch3,
  kHeadDim,
  kValueDim,
  kQueryLen,
  kKeyLen,
  kShapeFields
};
constexpr const char* kShapeFieldNames[] = {
    "the rank of query",      "batch dimension 0", "batch dimension 1",
    "batch dimension 2",      "batch dimension 3", "the head dimension E",
    "the value dimension Ev", "the query length",  "the key length"};
static_assert(std::size(kShapeFieldNames) == kShapeFields);

int64_t bits_of(double x) {
  int64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

// FNV-1a of a float32 copy of a per-head vector (slopes, sinks): ranks must hold the same.
int64_t hash_of(const std::optional<TensorView>& t) {
  if (!t) return 0;
  Tensor copy(DType::kFloat32, t->shape);
  convert(*t, copy.view());
  uint64_t h = 1469598103934665603ull;
  const auto* bytes = static_cast<const unsigned char*>(copy.data());
  for (size_t n = 0; n < copy.nbytes(); ++n) h = (h ^ bytes[n]) * 1099511628211ull;
  return static_cast<int64_t>(h | 1);
}

// Appends a signature's fields after the shape's, in order, with their names (for the
// message that names a disagreement; every rank appends the same fields).
class Fields {
 public:
  Fields(Signature& s, std::vector<std::string>& names) : s_(s), names_(names) {
    names_.assign(std::begin(kShapeFieldNames), std::end(kShapeFieldNames));
  }
  void put(std::string name, int64_t value) {
    if (names_.size() == kFields) throw Error("the collective check holds too few fields");
    s_.field[names_.size()] = value;
    names_.push_back(std::move(name));
  }
  // A score rule's option (for_each_score_rule), by its type: flags, enums and integers as
  // they are, numbers by their bits (0 when not given), the window by its two sides (-2 when
  // not given), per-head vectors by hash_of.
  template <class T>
  void operator()(const char* name, const T& value) {
    if constexpr (std::is_same_v<T, bool> || std::is_enum_v<T> || std::is_same_v<T, int64_t>) {
      put(name, static_cast<int64_t>(value));
    } else if constexpr (std::is_same_v<T, std::optional<double>>) {
      put(name, value ? bits_of(*value) : 0);
    } else if constexpr (std::is_same_v<T, std::optional<SlidingWindow>>) {
      put(std::string("the ") + name + "'s left side", value ? value->left : -2);
      put(std::string("the ") + name + "'s right side", value ? value->right : -2);
    } else if constexpr (std::is_same_v<T, std::optional<TensorView>>) {
      put(name, hash_of(value));
    } else {
      static_assert(sizeof(T) == 0, "a score rule's option of a type the ring cannot compare");
    }
  }

 private:
  Signature& s_;
  std::vector<std::string>& names_;
};

void set_message(Signature& s, const std::string& message) {
  s.failed = 1;
  std::snprintf(s.message, sizeof s.message, "%s", message.c_str());
}

// Every rank's signature, or the first failure as attend::Error on every rank.
std::vector<Signature> gather(const Communicator& comm, const char* who, const Signature& mine) {
  std::vector<Signature> all(static_cast<size_t>(comm.size()));
  auto sent = std::make_unique<Signature>(mine);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallgather(sent.get(), sizeof(Signature), MPI_BYTE, all.data(), sizeof(Signature),
                           MPI_BYTE, comm.get(), &request),
            "MPI_Iallgather");
  comm.wait_collective(request, "the collective check", sent, all);
  for (int r = 0; r < comm.size(); ++r) {
    const Signature& s = all[static_cast<size_t>(r)];
    if (s.failed) {
      throw AgreedError(std::string(who) + ": rank " + std::to_string(r) + ": " +
                        std::string(s.message, strnlen(s.message, sizeof s.message)));
    }
  }
  return all;
}

// This rank's signature; `names` receives its fields' names.
Signature signature_of(const TensorView& query, const TensorView& key, const TensorView& value,
                       const AttentionOptions& o, ShardLayout layout,
                       std::vector<std::string>& names) {
  Signature s;
  int64_t* f = s.field;
  try {
    for (auto [name, t] :
         {std::pair{"query", &query}, std::pair{"key", &key}, std::pair{"value", &value}}) {
      if (t->rank() < 2 || t->rank() > 6) {
        throw Error(std::string(name) + " must have 2 to 6 dimensions, got " +
                    std::to_string(t->rank()));
      }
      if (t->dtype != DType::kFloat32) {
        throw Error(std::string(name) +
                    ": context parallelism takes float32, float16 or "
                    "bfloat16, got " +
                    dtype_name(t->dtype));
      }
    }
    if (key.rank() != query.rank() || value.rank() != query.rank()) {
      throw Error("query, key and value must have the same rank");
    }
    if (o.need_weights) {
      throw Error(
          "need_weights is not available with context parallelism (the weights of a "
          "row are spread over every rank)");
    }
    if (o.block) throw Error("options.block is set by the ring itself; leave it empty");
    f[kRank] = query.rank();
    for (int d = 0; d + 2 < query.rank(); ++d) f[kBatch0 + d] = query.shape[d];
    f[kHeadDim] = query.shape.back(0);
    f[kValueDim] = value.shape.back(0);
    f[kQueryLen] = query.shape.back(1);
    f[kKeyLen] = key.shape.back(1);
    Fields fields(s, names);
    for_each_score_rule(o, fields);
    fields.put("scale", o.scale ? bits_of(*o.scale) : 0);
    fields.put("fully_masked_rows", static_cast<int64_t>(o.fully_masked_rows));
    fields.put("dropout", bits_of(o.dropout));
    fields.put("seed", static_cast<int64_t>(o.seed));
    fields.put("whether a mask is given", o.mask.has_value());
    fields.put("whether a bias is given", o.bias.has_value());
    fields.put("whether segment ids are given",
               o.segment_ids_query.has_value() + 2 * o.segment_ids_key.has_value());
    fields.put("user_rules' score_mod", o.user_rules && o.user_rules->modify);
    fields.put("user_rules' mask_mod", o.user_rules && o.user_rules->mask);
    fields.put("backend", static_cast<int64_t>(o.backend));
    fields.put("the shard layout", static_cast<int64_t>(layout));
    fields.put("compute (the products' precision)", static_cast<int64_t>(o.compute));
    int64_t key_segments_shape = 0;
    if (o.segment_ids_key) {  // it travels: every rank's must fit every query shard
      const TensorView& ids = *o.segment_ids_key;
      key_segments_shape = ids.rank();
      for (int d = 0; d + 1 < ids.rank(); ++d) {
        key_segments_shape = key_segments_shape * 1000003 + ids.shape[d];
      }
    }
    fields.put("the shape of segment_ids_key but its length", key_segments_shape);
  } catch (const Error& e) {
    set_message(s, e.what());
  }
  return s;
}

std::vector<Piece> pieces_of(ShardLayout layout, int64_t offset, int64_t shard_len, int64_t total,
                             int ranks, int rank) {
  if (layout == ShardLayout::kContiguous) return {Piece{0, offset, shard_len}};
  std::vector<Piece> pieces;
  int64_t local = 0;
  for (const ShardPiece& p : shard_pieces(layout, total, ranks, rank)) {
    pieces.push_back(Piece{local, p.offset, p.length});
    local += p.length;
  }
  return pieces;
}

// A mask or bias: (..., Lq_r or 1, Lk or 1), the columns in global key order.
void check_rows_and_columns(const char* name, const TensorView& t, int64_t rows, int64_t columns) {
  const int64_t r = t.rank() >= 2 ? t.shape.back(1) : 1, c = t.rank() >= 1 ? t.shape.back(0) : 1;
  if ((r != rows && r != 1) || (c != columns && c != 1)) {
    throw Error(std::string(name) + " " + t.shape.str() +
                ": context parallelism takes this rank's query rows (" + std::to_string(rows) +
                " or 1) by every key of the whole sequence (" + std::to_string(columns) + " or 1)");
  }
}

}  // namespace

int64_t RingPlan::query_shard_len_of(int r) const {
  int64_t length = 0;
  for (const Piece& p : queries[static_cast<size_t>(r)]) length += p.length;
  return length;
}

RingPlan agree_on_plan(const Communicator& comm, const char* who, const TensorView& query,
                       const TensorView& key, const TensorView& value,
                       const AttentionOptions& options, ShardLayout layout,
                       const std::function<void(const RingPlan&)>& local_check) {
  // 1. Each rank's shapes and options; all must agree with rank 0's but for the lengths.
  std::vector<std::string> names;
  const std::vector<Signature> all =
      gather(comm, who, signature_of(query, key, value, options, layout, names));
  const Signature& first = all[0];
  for (int r = 1; r < comm.size(); ++r) {
    for (int f = 0; f < static_cast<int>(names.size()); ++f) {
      if (f == kQueryLen || f == kKeyLen) continue;
      if (all[static_cast<size_t>(r)].field[f] != first.field[f]) {
        throw AgreedError(std::string(who) + ": rank " + std::to_string(r) +
                          " disagrees with rank 0 on " + names[static_cast<size_t>(f)] + " (" +
                          std::to_string(all[static_cast<size_t>(r)].field[f]) + " against " +
                          std::to_string(first.field[f]) + ")");
      }
    }
  }
  RingPlan plan;
  plan.ranks = comm.size();
  plan.rank = comm.rank();
  plan.batch_shape = Shape::from(query.shape.data(), query.rank() - 2);
  plan.batch = plan.batch_shape.numel();
  plan.head_dim = query.shape.back(0);
  plan.value_dim = value.shape.back(0);
  for (const Signature& s : all) {
    plan.query_len += s.field[kQueryLen];
    plan.key_len += s.field[kKeyLen];
  }
  // 2. The lengths the layout needs.
  int64_t query_offset = 0, key_offset = 0;
  for (int r = 0; r < comm.size(); ++r) {
    const Signature& s = all[static_cast<size_t>(r)];
    const int64_t lq = s.field[kQueryLen], lk = s.field[kKeyLen];
    if (layout == ShardLayout::kZigzag &&
        (lq != first.field[kQueryLen] || lk != first.field[kKeyLen] || lq % 2 || lk % 2)) {
      throw AgreedError(
          std::string(who) +
          ": the zigzag layout needs every rank to hold two equal "
          "chunks of queries and of keys (even lengths, the same on every rank); rank " +
          std::to_string(r) + " holds " + std::to_string(lq) + " queries and " +
          std::to_string(lk) + " keys" +
          (r == 0 ? std::string()
                  : ", rank 0 " + std::to_string(first.field[kQueryLen]) + " and " +
                        std::to_string(first.field[kKeyLen])));
    }
    if (lk < 1) {
      throw AgreedError(std::string(who) + ": rank " + std::to_string(r) + " holds no key");
    }
    plan.queries.push_back(pieces_of(layout, query_offset, lq, plan.query_len, comm.size(), r));
    plan.keys.push_back(pieces_of(layout, key_offset, lk, plan.key_len, comm.size(), r));
    plan.key_shard_len.push_back(lk);
    query_offset += lq;
    key_offset += lk;
  }
  // 3. The library's own validation of this rank's first block (its queries against its own
  // keys), and the ring's shape rules for mask and bias; then every rank learns the outcome.
  Signature mine;
  try {
    if (options.mask) {
      check_rows_and_columns("mask", *options.mask, plan.query_shard_len(), plan.key_len);
    }
    if (options.bias) {
      check_rows_and_columns("bias", *options.bias, plan.query_shard_len(), plan.key_len);
    }
    if (options.segment_ids_key && options.segment_ids_key->rank() >= 1 &&
        options.segment_ids_key->shape.back(0) != key.shape.back(1)) {
      throw Error("segment_ids_key " + options.segment_ids_key->shape.str() +
                  " should end in this rank's key length " + std::to_string(key.shape.back(1)));
    }
    const Piece& q = plan.queries[static_cast<size_t>(plan.rank)][0];
    const Piece& k = plan.keys[static_cast<size_t>(plan.rank)][0];
    const AttentionOptions block = block_options(options, plan, q, k, options.segment_ids_key);
    (void)attention_kernel(narrow(query, query.rank() - 2, q.local, q.length),
                           narrow(key, key.rank() - 2, k.local, k.length),
                           narrow(value, value.rank() - 2, k.local, k.length), block);
    if (local_check) local_check(plan);
  } catch (const Error& e) {
    set_message(mine, e.what());
  }
  (void)gather(comm, who, mine);
  return plan;
}

void copy_view(const TensorView& from, const TensorView& to) {
  const int rank = from.rank();
  if (from.dtype != to.dtype || from.shape != to.shape || rank < 1 || from.strides[rank - 1] != 1 ||
      to.strides[rank - 1] != 1) {
    convert(from, to);
    return;
  }
  const int64_t width = from.shape[rank - 1];
  const auto bytes = static_cast<size_t>(width) * dtype_size(from.dtype);
  const int64_t rows = width == 0 ? 0 : from.numel() / width;
  int64_t index[Shape::kMaxRank] = {};
  for (int64_t row = 0; row < rows; ++row) {
    int64_t from_offset = 0, to_offset = 0;
    for (int d = 0; d + 1 < rank; ++d) {
      from_offset += index[d] * from.strides[d];
      to_offset += index[d] * to.strides[d];
    }
    std::memcpy(
        static_cast<char*>(to.data) + to_offset * static_cast<int64_t>(dtype_size(to.dtype)),
        static_cast<const char*>(from.data) +
            from_offset * static_cast<int64_t>(dtype_size(from.dtype)),
        bytes);
    for (int d = rank - 2; d >= 0; --d) {
      if (++index[d] < from.shape[d]) break;
      index[d] = 0;
    }
  }
}

TensorView as_float32(const TensorView& t, Tensor& storage) {
  if (t.dtype != DType::kFloat16 && t.dtype != DType::kBFloat16) return t;
  storage = Tensor(DType::kFloat32, t.shape);
  convert(t, storage.view());
  return storage.view();
}

Tensor in_dtype(Tensor t, DType dtype) {
  if (t.empty() || t.dtype() == dtype) return t;
  Tensor out(dtype, t.shape());
  convert(t.view(), out.view());
  return out;
}

TensorView narrow(TensorView view, int dim, int64_t start, int64_t length) {
  view.data = static_cast<char*>(view.data) +
              start * view.strides[dim] * static_cast<int64_t>(dtype_size(view.dtype));
  view.shape[dim] = length;
  return view;
}

TensorView block_slice(const TensorView& t, const Piece& q, const Piece& k) {
  TensorView v = t;
  if (v.rank() >= 2 && v.shape.back(1) != 1) v = narrow(v, v.rank() - 2, q.local, q.length);
  if (v.rank() >= 1 && v.shape.back(0) != 1) v = narrow(v, v.rank() - 1, k.global, k.length);
  return v;
}

AttentionOptions block_options(const AttentionOptions& options, const RingPlan& plan,
                               const Piece& q, const Piece& k,
                               const std::optional<TensorView>& key_segments) {
  AttentionOptions o = options;
  o.block = BlockPositions{q.global, k.global, plan.query_len, plan.key_len};
  if (o.mask) o.mask = block_slice(*o.mask, q, k);
  if (o.bias) o.bias = block_slice(*o.bias, q, k);
  if (o.segment_ids_query && o.segment_ids_query->rank() >= 1) {
    const TensorView& ids = *o.segment_ids_query;
    o.segment_ids_query = narrow(ids, ids.rank() - 1, q.local, q.length);
  }
  if (key_segments && key_segments->rank() >= 1) {
    o.segment_ids_key = narrow(*key_segments, key_segments->rank() - 1, k.local, k.length);
  }
  o.sinks.reset();
  o.fully_masked_rows = FullyMaskedRows::kZero;
  o.need_logsumexp = true;
  o.need_weights = false;
  return o;
}

bool may_leave_rows_empty(const AttentionOptions& o) {
  const bool may_exclude =
      o.causal || o.window || o.mask || o.segment_ids_query || (o.user_rules && o.user_rules->mask);
  return may_exclude && o.fully_masked_rows == FullyMaskedRows::kUniform && !o.sinks;
}

bool block_is_hidden(const AttentionOptions& block, int64_t query_len, int64_t key_len) {
  attend::detail::SdpaParams p;
  p.query_len = query_len;
  p.key_len = key_len;
  attend::detail::fill_positional_rules(p, block);
  return attend::detail::excludes_every_key(p);
}

// ---- KeyBlocks -----------------------------------------------------------------------------

KeyBlocks::KeyBlocks(const RingPlan& plan, const TensorView& key, const TensorView& value,
                     const std::optional<TensorView>& segment_ids_key)
    : plan_(plan), documents_(segment_ids_key.has_value()) {
  if (documents_) {
    segment_shape_ = Shape::from(segment_ids_key->shape.data(), segment_ids_key->rank() - 1);
  }
  int64_t largest = 0;
  for (int r = 0; r < plan.ranks; ++r) largest = std::max(largest, floats_for(r));
  if (largest * static_cast<int64_t>(sizeof(float)) > INT_MAX) {
    throw Error("context parallelism: a key/value shard of " +
                std::to_string(largest * static_cast<int64_t>(sizeof(float))) +
                " bytes exceeds one MPI message (2 GiB); use more ranks");
  }
  for (Tensor& b : buffers_) b = Tensor(DType::kFloat32, Shape({std::max<int64_t>(largest, 1)}));
  // This rank's own shard, packed.
  const int64_t lk = key.shape.back(1);
  Shape k_shape = plan.batch_shape, v_shape = plan.batch_shape;
  k_shape.push_back(lk);
  k_shape.push_back(plan.head_dim);
  v_shape.push_back(lk);
  v_shape.push_back(plan.value_dim);
  float* at = buffers_[0].data_as<float>();
  copy_view(key, TensorView(at, DType::kFloat32, k_shape));
  at += plan.batch * lk * plan.head_dim;
  copy_view(value, TensorView(at, DType::kFloat32, v_shape));
  at += plan.batch * lk * plan.value_dim;
  if (documents_) convert(*segment_ids_key, TensorView(at, DType::kInt32, segment_ids_key->shape));
}

int64_t KeyBlocks::floats_for(int owner) const {
  const int64_t lk = plan_.key_shard_len[static_cast<size_t>(owner)];
  return plan_.batch * lk * (plan_.head_dim + plan_.value_dim) +
         (documents_ ? segment_shape_.numel() * lk : 0);
}

int KeyBlocks::owner(int step) const {
  return (plan_.rank - step % plan_.ranks + plan_.ranks) % plan_.ranks;
}

TensorView KeyBlocks::key(int step) const {
  Shape shape = plan_.batch_shape;
  shape.push_back(plan_.key_shard_len[static_cast<size_t>(owner(step))]);
  shape.push_back(plan_.head_dim);
  return TensorView(const_cast<float*>(current()), DType::kFloat32, shape);
}

TensorView KeyBlocks::value(int step) const {
  const int64_t lk = plan_.key_shard_len[static_cast<size_t>(owner(step))];
  Shape shape = plan_.batch_shape;
  shape.push_back(lk);
  shape.push_back(plan_.value_dim);
  return TensorView(const_cast<float*>(current()) + plan_.batch * lk * plan_.head_dim,
                    DType::kFloat32, shape);
}

std::optional<TensorView> KeyBlocks::segments(int step) const {
  if (!documents_) return std::nullopt;
  const int64_t lk = plan_.key_shard_len[static_cast<size_t>(owner(step))];
  Shape shape = segment_shape_;
  shape.push_back(lk);
  return TensorView(
      const_cast<float*>(current()) + plan_.batch * lk * (plan_.head_dim + plan_.value_dim),
      DType::kInt32, shape);
}

KeyBlocks::~KeyBlocks() {
  if (!settle(requests_, 2)) {
    for (Tensor& b : buffers_) Communicator::keep_forever(std::move(b));
  }
}

void KeyBlocks::start(const Communicator& comm, int step) {
  const int64_t send = floats_for(owner(step)), receive = floats_for(owner(step + 1));
  check_mpi(MPI_Irecv(buffers_[1 - current_].data(), static_cast<int>(receive), MPI_FLOAT,
                      comm.previous(), step, comm.get(), &requests_[0]),
            "MPI_Irecv of a key/value shard");
  check_mpi(MPI_Isend(buffers_[current_].data(), static_cast<int>(send), MPI_FLOAT, comm.next(),
                      step, comm.get(), &requests_[1]),
            "MPI_Isend of a key/value shard");
  bytes_sent_ += static_cast<uint64_t>(send) * sizeof(float);
}

double KeyBlocks::finish(const Communicator& comm) {
  const auto start = std::chrono::steady_clock::now();
  comm.wait(requests_, 2, "waiting for a key/value shard");
  current_ = 1 - current_;
  return seconds_since(start);
}

double KeyBlocks::advance(const Communicator& comm, int step, bool overlap) {
  double waited = 0;
  if (step > 0) {
    if (!overlap) {  // every rank done computing: the wait is the transfer alone
      comm.barrier("the barrier before a transfer");
      start(comm, step - 1);
    }
    waited = finish(comm);
  }
  if (overlap && step + 1 < plan_.ranks) start(comm, step);
  comm.fault_point();
  return waited;
}

}  // namespace attend::mpi::detail
