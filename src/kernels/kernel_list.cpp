#include "kernels/kernel_list.hpp"

#include <string>

#include "attend/error.hpp"
#include "kernels/fused_sdpa.hpp"
#include "kernels/fused_sdpa_backward.hpp"
#include "kernels/short_keys.hpp"
#include "reference/reference_sdpa.hpp"
#include "reference/reference_sdpa_backward.hpp"
#include "shape_policy.hpp"

namespace attend::detail {
namespace {

template <class Params>
const char* reference_rejects(const Params&) {
  return nullptr;
}

template <class Params>
struct Candidate {
  Backend backend;
  const char* name;
  const char* (*rejects)(const Params&);
  void (*run)(const Params&);
};

void short_keys_or_next(const SdpaParams& params);

// Fastest first; the reference last, accepting everything.
constexpr Candidate<SdpaParams> kCandidates[] = {
    {Backend::kFused, "fused short keys", fused_short_keys_rejects, short_keys_or_next},
    {Backend::kFused, "fused rows", fused_sdpa_rows_rejects, fused_sdpa_rows},
    {Backend::kFused, "fused tiles", fused_sdpa_tiles_rejects, fused_sdpa_tiles},
    {Backend::kReference, "reference", reference_rejects<SdpaParams>, reference_sdpa},
};
constexpr Candidate<SdpaBackwardParams> kBackwardCandidates[] = {
    {Backend::kFused, "fused", fused_sdpa_backward_rejects, fused_sdpa_backward},
    {Backend::kReference, "reference", reference_rejects<SdpaBackwardParams>,
     reference_sdpa_backward},
};

// The short-key entry's run. A prepared call keeps the function chosen for its first key
// length (AttentionPlan with variable_key_length; nothing else it would judge changes between
// calls): past kMaxShortKeys keys it runs the entry the list would choose for the new length,
// as the unprepared call does.
void short_keys_or_next(const SdpaParams& params) {
  if (params.key_len <= kMaxShortKeys) return fused_short_keys(params);
  for (const Candidate<SdpaParams>& c : kCandidates) {
    if (c.run != short_keys_or_next && c.rejects(params) == nullptr) return c.run(params);
  }
}

template <class Params, size_t N>
const Candidate<Params>& choose(const Candidate<Params> (&candidates)[N], const Params& params,
                                Backend backend) {
  std::string reasons;
  for (const Candidate<Params>& c : candidates) {
    if (backend != Backend::kAuto && c.backend != backend) continue;
    const char* why = c.rejects(params);
    if (why == nullptr) return c;
    reasons += std::string(reasons.empty() ? "" : "; ") + c.name + ": " + why;
  }
  if (backend != Backend::kAuto) {
    throw Error("the requested backend cannot run this problem (" + reasons + ")");
  }
  return candidates[N - 1];
}

}  // namespace

void run_kernel(const SdpaParams& params, Backend backend) {
  choose(kCandidates, params, backend).run(params);
}

KernelRun chosen_kernel_run(const SdpaParams& params, Backend backend) {
  return choose(kCandidates, params, backend).run;
}

void run_backward_kernel(const SdpaBackwardParams& params, Backend backend) {
  choose(kBackwardCandidates, params, backend).run(params);
}

std::string chosen_kernel(const SdpaParams& params, Backend backend) {
  const Candidate<SdpaParams>& c = choose(kCandidates, params, backend);
  std::string name = c.name;
  if (c.backend == Backend::kFused && c.run != short_keys_or_next) {
    const FusedPlan plan = fused_sdpa_plan(params, c.run == fused_sdpa_rows);
    if (plan.grouped) name = "fused grouped-query tiles";
    if (params.f16_products()) {
      name += " (float16 products)";
    } else if (params.bf16_products()) {
      name += params.amx_tiles ? " (bfloat16 products, AMX tiles)" : " (bfloat16 products)";
    } else if (params.stored_kv()) {
      name += std::string(" (") + dtype_name(params.kv_format) + " K/V)";
    }
    if (params.block_table) name += " (paged)";
    if (plan.chunks > 1) name += " + key split (" + std::to_string(plan.chunks) + " chunks)";
  }
  return name;
}

}  // namespace attend::detail
