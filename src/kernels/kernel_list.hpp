// kernel_list.hpp: the ordered list of attention implementations (after oneDNN's
// cpu_*_list.cpp). Each candidate may reject a problem and say why; the reference is last
// and accepts everything.
#pragma once

#include <string>

#include "attend/attention_options.hpp"
#include "sdpa_params.hpp"

namespace attend::detail {

// Runs the first candidate that accepts `params` (only the named one for a forced backend;
// attend::Error with its reason when that one rejects).
void run_kernel(const SdpaParams& params, Backend backend);

// The function run_kernel would call for `params` (a prepared call keeps it: the choice
// depends on the backend and the query length only).
using KernelRun = void (*)(const SdpaParams&);
KernelRun chosen_kernel_run(const SdpaParams& params, Backend backend);

// The same for the backward pass.
void run_backward_kernel(const SdpaBackwardParams& params, Backend backend);

// The candidate run_kernel would pick and how it splits the keys: "fused short keys" (never
// split), "fused rows", "fused tiles",
// "fused grouped-query tiles" (the rows entry's G·Lq rows of a K/V head as query tiles),
// each with " + key split (N chunks)", or "reference".
std::string chosen_kernel(const SdpaParams& params, Backend backend);

}  // namespace attend::detail
