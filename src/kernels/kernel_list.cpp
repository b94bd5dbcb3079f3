#include "kernels/kernel_list.hpp"

#include <string>

#include "attend/error.hpp"
#include "kernels/fused_sdpa.hpp"
#include "reference/reference_sdpa.hpp"

namespace attend::detail {
namespace {

const char* reference_rejects(const SdpaParams&) { return nullptr; }

struct Candidate {
  Backend backend;
  const char* name;
  const char* (*rejects)(const SdpaParams&);
  void (*run)(const SdpaParams&);
};

// Fastest first; the reference last, accepting everything.
constexpr Candidate kCandidates[] = {
    {Backend::kFused, "fused", fused_sdpa_rejects, fused_sdpa},
    {Backend::kReference, "reference", reference_rejects, reference_sdpa},
};

const Candidate& choose(const SdpaParams& params, Backend backend) {
  for (const Candidate& c : kCandidates) {
    if (backend != Backend::kAuto && c.backend != backend) continue;
    const char* why = c.rejects(params);
    if (why == nullptr) return c;
    if (backend != Backend::kAuto) {
      throw Error(std::string("backend ") + c.name + " cannot run this problem: " + why);
    }
  }
  return kCandidates[std::size(kCandidates) - 1];
}

}  // namespace

void run_kernel(const SdpaParams& params, Backend backend) { choose(params, backend).run(params); }

const char* chosen_kernel(const SdpaParams& params, Backend backend) {
  return choose(params, backend).name;
}

}  // namespace attend::detail
