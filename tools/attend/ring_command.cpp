// ring_command.cpp: `mpirun -np N attend ring --query Q.npy --key K.npy --value V.npy
// --out O.npy [--lse L.npy] [--causal] [--layout contiguous|zigzag] [--method ring|ulysses]
// ...`: attention over N ranks (attend/mpi/ring.hpp).
//
// Two ways to give the data:
//   - whole files: rank 0 reads Q, K and V (..., L, E) and sends each rank its shard (the
//     layout's even split); rank 0 gathers the output and writes it;
//   - shard files: paths holding "{rank}" (q_{rank}.npy) are read by each rank for itself
//     (shards of any lengths with the contiguous layout) and the outputs written per rank.
// Every step that can fail on one rank (reading, checking, writing) ends with all ranks
// learning the outcome, so a failure is an error on every rank and nothing is left waiting;
// outputs are written all-or-nothing over the ranks (staged, then renamed once all staged).
#include "ring_command.hpp"

#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/mpi/ring.hpp"
#include "attend/npy.hpp"
#include "attend/sdpa.hpp"
#include "mpi_session.hpp"
#include "ring_shards.hpp"
#include "score_rule_options.hpp"

namespace attend::cli {
namespace {

struct RingArguments {
  std::string query_path, key_path, value_path, output_path, lse_path;
  ScoreRuleArguments rules;  // shared with `attend sdpa`
  std::string layout = "contiguous";
  std::string method = "ring";
  std::string threads_text;
  bool quiet = false;
};

bool per_rank(const std::string& path) { return path.find("{rank}") != std::string::npos; }

std::string for_rank(std::string path, int rank) {
  for (size_t at; (at = path.find("{rank}")) != std::string::npos;) {
    path.replace(at, 6, std::to_string(rank));
  }
  return path;
}

// Throws "rank r: message" on every rank when any rank's `error` is not empty.
void agree(MPI_Comm comm, const std::string& error) {
  constexpr int kBytes = 512;
  int ranks = 1;
  MPI_Comm_size(comm, &ranks);
  char mine[kBytes] = {};
  std::snprintf(mine, sizeof mine, "%s", error.c_str());
  std::vector<char> all(static_cast<size_t>(ranks) * kBytes);
  MPI_Allgather(mine, kBytes, MPI_CHAR, all.data(), kBytes, MPI_CHAR, comm);
  for (int r = 0; r < ranks; ++r) {
    const char* message = all.data() + static_cast<size_t>(r) * kBytes;
    if (message[0] != '\0') {
      throw Error("rank " + std::to_string(r) + ": " +
                  std::string(message, strnlen(message, kBytes)));
    }
  }
}

template <class F>
void on_every_rank(MPI_Comm comm, const F& step) {
  std::string error;
  try {
    step();
  } catch (const std::exception& e) {
    error = e.what();
    if (error.empty()) error = "unknown error";
  }
  agree(comm, error);
}

AttentionOptions options_from(const RingArguments& a, const CLI::App& command) {
  AttentionOptions o;
  apply_score_rule_options(a.rules, command, o);
  o.num_threads = threads_from(command, a.threads_text, 1);
  return o;
}

mpi::ShardLayout layout_from(const std::string& name) {
  if (name == "contiguous") return mpi::ShardLayout::kContiguous;
  if (name == "zigzag") return mpi::ShardLayout::kZigzag;
  throw Error("--layout must be contiguous or zigzag, got " + name);
}

Tensor as_float32(const std::string& option, const std::string& path, Tensor t) {
  if (t.dtype() == DType::kFloat32) return t;
  if (t.dtype() != DType::kFloat16) {
    throw Error(option + " " + path + ": dtype " + dtype_name(t.dtype()) +
                " is not supported (float32 or float16)");
  }
  Tensor f(DType::kFloat32, t.shape());
  convert(t.view(), f.view());
  return f;
}

// Rank 0's whole tensor, its shape sent to every rank, each rank's shard sent to it.
Tensor scatter_shards(MPI_Comm comm, const std::optional<Tensor>& whole, mpi::ShardLayout layout) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);
  int64_t dims[Shape::kMaxRank + 1] = {};
  if (rank == 0) {
    dims[0] = whole->shape().rank();
    for (int d = 0; d < whole->shape().rank(); ++d) dims[d + 1] = whole->shape()[d];
  }
  MPI_Bcast(dims, Shape::kMaxRank + 1, MPI_INT64_T, 0, comm);
  Shape shape = Shape::from(dims + 1, static_cast<int>(dims[0]));
  const int64_t length = shape[shape.rank() - 2];
  std::vector<std::vector<mpi::ShardPiece>> pieces;
  on_every_rank(comm, [&] {
    for (int r = 0; r < ranks; ++r) pieces.push_back(mpi::shard_pieces(layout, length, ranks, r));
  });
  Shape mine = shape;
  mine[mine.rank() - 2] = 0;
  for (const auto& p : pieces[static_cast<size_t>(rank)]) mine[mine.rank() - 2] += p.length;
  Tensor shard(DType::kFloat32, mine);
  if (rank == 0) {
    for (int r = 1; r < ranks; ++r) {
      const Tensor part = gather_rows(whole->view(), pieces[static_cast<size_t>(r)]);
      MPI_Send(part.data(), static_cast<int>(part.numel()), MPI_FLOAT, r, 0, comm);
    }
    const Tensor part = gather_rows(whole->view(), pieces[0]);
    std::memcpy(shard.data(), part.data(), part.nbytes());
  } else {
    MPI_Recv(shard.data(), static_cast<int>(shard.numel()), MPI_FLOAT, 0, 0, comm,
             MPI_STATUS_IGNORE);
  }
  return shard;
}

// Every rank's shard (..., L_r, D) to rank 0, put back at its positions in (..., L, D).
std::optional<Tensor> gather_whole(MPI_Comm comm, const Tensor& shard, int64_t length,
                                   mpi::ShardLayout layout) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);
  if (rank != 0) {
    MPI_Send(shard.data(), static_cast<int>(shard.numel()), MPI_FLOAT, 0, 1, comm);
    return std::nullopt;
  }
  Shape shape = shard.shape();
  shape[shape.rank() - 2] = length;
  Tensor whole(DType::kFloat32, shape);
  for (int r = 0; r < ranks; ++r) {
    const auto pieces = mpi::shard_pieces(layout, length, ranks, r);
    Shape part_shape = shape;
    part_shape[part_shape.rank() - 2] = 0;
    for (const auto& p : pieces) part_shape[part_shape.rank() - 2] += p.length;
    Tensor part(DType::kFloat32, part_shape);
    if (r == 0) {
      std::memcpy(part.data(), shard.data(), shard.nbytes());
    } else {
      MPI_Recv(part.data(), static_cast<int>(part.numel()), MPI_FLOAT, r, 1, comm,
               MPI_STATUS_IGNORE);
    }
    scatter_rows(part.view(), pieces, whole.view());
  }
  return whole;
}

// (..., L) as (..., L, 1) and back: the log-sum-exp through the row helpers.
Tensor with_column(Tensor t) {
  Shape s = t.shape();
  s.push_back(1);
  Tensor out(DType::kFloat32, s);
  std::memcpy(out.data(), t.data(), t.nbytes());
  return out;
}
Tensor without_column(const Tensor& t) {
  const Shape s = Shape::from(t.shape().data(), t.shape().rank() - 1);
  Tensor out(DType::kFloat32, s);
  std::memcpy(out.data(), t.data(), t.nbytes());
  return out;
}

void run_ring(const RingArguments& a, const CLI::App& command) {
  ensure_mpi();
  MPI_Comm comm = MPI_COMM_WORLD;
  int rank = 0, ranks = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);
  AttentionOptions options;
  mpi::ContextParallelOptions parallel;
  bool shards = false;
  on_every_rank(comm, [&] {
    options = options_from(a, command);
    parallel.layout = layout_from(a.layout);
    if (a.method != "ring" && a.method != "ulysses") {
      throw Error("--method must be ring or ulysses, got " + a.method);
    }
    shards = per_rank(a.query_path);
    for (const std::string* path : {&a.key_path, &a.value_path, &a.output_path}) {
      if (per_rank(*path) != shards) {
        throw Error(
            "--query, --key, --value and --out must all name per-rank files ({rank}) or "
            "all name whole files");
      }
    }
    if (!a.lse_path.empty() && per_rank(a.lse_path) != shards) {
      throw Error("--lse must name per-rank files ({rank}) exactly when the inputs do");
    }
    if (shards || rank == 0) {  // whole files: rank 0 writes them
      check_output_path("--out", shards ? for_rank(a.output_path, rank) : a.output_path);
      if (!a.lse_path.empty()) {
        check_output_path("--lse", shards ? for_rank(a.lse_path, rank) : a.lse_path);
      }
    }
  });

  // 1. Inputs: each rank its shard.
  Tensor q, k, v;
  if (shards) {
    on_every_rank(comm, [&] {
      q = as_float32("--query", a.query_path, read_input("--query", for_rank(a.query_path, rank)));
      k = as_float32("--key", a.key_path, read_input("--key", for_rank(a.key_path, rank)));
      v = as_float32("--value", a.value_path, read_input("--value", for_rank(a.value_path, rank)));
    });
  } else {
    std::optional<Tensor> whole[3];
    on_every_rank(comm, [&] {
      if (rank != 0) return;
      whole[0] = as_float32("--query", a.query_path, read_input("--query", a.query_path));
      whole[1] = as_float32("--key", a.key_path, read_input("--key", a.key_path));
      whole[2] = as_float32("--value", a.value_path, read_input("--value", a.value_path));
      for (const auto& t : whole) {
        if (t->shape().rank() < 2) {
          throw Error("query, key and value need (..., L, E): at least 2 dimensions");
        }
      }
    });
    q = scatter_shards(comm, whole[0], parallel.layout);
    k = scatter_shards(comm, whole[1], parallel.layout);
    v = scatter_shards(comm, whole[2], parallel.layout);
  }

  // 2. Attention (its checks are collective already).
  mpi::RingStatistics stats;
  parallel.statistics = &stats;
  const mpi::ShardResult r =
      a.method == "ring"
          ? mpi::ring_attention(comm, q.view(), k.view(), v.view(), options, parallel)
          : mpi::ulysses_attention(comm, q.view(), k.view(), v.view(), options, parallel);

  // 3. Outputs, all-or-nothing over the ranks.
  std::vector<std::unique_ptr<StagedNpyFile>> staged;
  const auto stage = [&](const std::string& option, const std::string& path, const TensorView& t) {
    try {
      staged.push_back(std::make_unique<StagedNpyFile>(path, t));
    } catch (const Error& e) {
      throw Error(option + " " + e.what());
    }
  };
  std::optional<Tensor> output, lse;
  if (shards) {
    on_every_rank(comm, [&] {
      stage("--out", for_rank(a.output_path, rank), r.output.view());
      if (!a.lse_path.empty()) stage("--lse", for_rank(a.lse_path, rank), r.logsumexp.view());
    });
  } else {
    int64_t length = 0, mine = q.shape()[q.shape().rank() - 2];
    MPI_Allreduce(&mine, &length, 1, MPI_INT64_T, MPI_SUM, comm);
    output = gather_whole(comm, r.output, length, parallel.layout);
    if (!a.lse_path.empty()) {
      const std::optional<Tensor> column =
          gather_whole(comm, with_column(r.logsumexp.clone()), length, parallel.layout);
      if (column) lse = without_column(*column);
    }
    on_every_rank(comm, [&] {
      if (rank != 0) return;
      stage("--out", a.output_path, output->view());
      if (lse) stage("--lse", a.lse_path, lse->view());
    });
  }
  on_every_rank(comm, [&] {
    for (auto& file : staged) file->commit();
  });
  if (rank == 0 && !a.quiet) {
    std::printf(
        "attend ring: %d rank(s), %s, %s layout; rank 0: %d step(s), %lld block(s) "
        "computed, %lld skipped, %.3f s (compute %.3f s, waiting %.3f s), %.1f MB sent\n",
        ranks, a.method.c_str(), a.layout.c_str(), stats.steps,
        static_cast<long long>(stats.blocks_computed), static_cast<long long>(stats.blocks_skipped),
        stats.total_seconds, stats.compute_seconds, stats.wait_seconds,
        static_cast<double>(stats.bytes_sent) / 1e6);
  }
}

}  // namespace

Command add_ring_command(CLI::App& app) {
  auto a = std::make_shared<RingArguments>();
  CLI::App* c = app.add_subcommand(
      "ring",
      "Attention with the sequence split over MPI ranks (run under mpirun): ring or "
      "head-parallel (Ulysses)");
  c->add_option("--query", a->query_path, "Q.npy (..., Lq, E), or per-rank q_{rank}.npy")
      ->type_name("FILE")
      ->required();
  c->add_option("--key", a->key_path, "K.npy (..., Lk, E), or per-rank k_{rank}.npy")
      ->type_name("FILE")
      ->required();
  c->add_option("--value", a->value_path, "V.npy (..., Lk, Ev), or per-rank v_{rank}.npy")
      ->type_name("FILE")
      ->required();
  c->add_option("--out", a->output_path, "output .npy (gathered by rank 0), or o_{rank}.npy")
      ->type_name("FILE")
      ->required();
  c->add_option("--lse", a->lse_path, "log-sum-exp .npy (..., Lq), as --out")->type_name("FILE");
  add_score_rule_options(*c, a->rules);
  c->add_option("--layout", a->layout, "contiguous (default) or zigzag (balanced causal work)")
      ->type_name("CHOICE")
      ->check(CLI::IsMember({"contiguous", "zigzag"}));
  c->add_option("--method", a->method, "ring (default) or ulysses (heads over ranks)")
      ->type_name("CHOICE")
      ->check(CLI::IsMember({"ring", "ulysses"}));
  add_threads_option(*c, a->threads_text, "1 per rank");
  c->add_flag("--quiet", a->quiet, "no summary line");
  return {c, [a, c] { run_ring(*a, *c); }};
}

}  // namespace attend::cli
