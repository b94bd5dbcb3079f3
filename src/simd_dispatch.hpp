// simd_dispatch.hpp: Highway's dynamic dispatch with attend's own choice of target.
//
// HWY_DYNAMIC_DISPATCH indexes a HWY_EXPORT table with hwy::GetChosenTarget(), one choice for
// the whole process: capping it (hwy::DisableTargets) would cap every other user of Highway in
// the program. attend keeps its own choice instead (runtime.cpp: the CPU's targets, read once,
// capped by ATTEND_MAX_SIMD or set_max_simd_target) and indexes the same tables with it through
// ATTEND_DISPATCH, which takes the place of HWY_DYNAMIC_DISPATCH in attend's sources.
#pragma once

#include <hwy/highway.h>

#include <cstddef>
#include <cstdint>

namespace attend::detail {

// The targets attend dispatches among now, as HWY_TARGETS bits: those the CPU supports,
// without the ones above the cap. Applies ATTEND_MAX_SIMD on first use (throws attend::Error
// when it names a target that is not compiled in).
int64_t dispatch_targets();

// The entry of a HWY_EXPORT table for the best of `targets` that the calling file compiled
// (`compiled`: its HWY_CHOSEN_TARGET_MASK_TARGETS), the last entry (EMU128) when none is. Never
// entry 0: that one is Highway's chooser, which writes the process-wide choice.
inline size_t dispatch_index(int64_t targets, int64_t compiled) {
  const int64_t chosen =
      (HWY_CHOSEN_TARGET_SHIFT(targets) | HWY_CHOSEN_TARGET_MASK_SCALAR) & compiled;
  return hwy::Num0BitsBelowLS1Bit_Nonzero64(static_cast<uint64_t>(chosen));
}

}  // namespace attend::detail

// ATTEND_DISPATCH(Function)(arguments): as HWY_DYNAMIC_DISPATCH, with attend's target. A file
// compiled for one target only has a one-entry table: it calls that target, as Highway does
// (after the same check of ATTEND_MAX_SIMD).
#if HWY_IDE || ((HWY_TARGETS & (HWY_TARGETS - 1)) == 0)
#define ATTEND_DISPATCH(FUNC_NAME) \
  ((void)::attend::detail::dispatch_targets(), HWY_STATIC_DISPATCH(FUNC_NAME))
#else
#define ATTEND_DISPATCH(FUNC_NAME)                                   \
  (*(HWY_DISPATCH_TABLE(FUNC_NAME)[::attend::detail::dispatch_index( \
      ::attend::detail::dispatch_targets(), HWY_CHOSEN_TARGET_MASK_TARGETS)]))
#endif
