// allocation_fault.hpp: injected allocation failure for one test program. Include it in exactly
// one source file of the program: it replaces the program's malloc and aligned_alloc (which
// the library's Tensor, its work buffers through Highway, and operator new all reach) so that
// they fail for sizes at or above a threshold while an AllocationFault is alive. Small
// allocations (libgomp's, error messages) still succeed. Not under AddressSanitizer or
// ThreadSanitizer, which own malloc: there kAllocationFaultsAvailable is false.
#pragma once

#include <errno.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

// gcc defines __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__; clang 14 defines neither and answers
// __has_feature instead (without this, a clang ASan build replaced ASan's malloc and died at
// startup).
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define ATTEND_UNDER_SANITIZER 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || defined(ATTEND_UNDER_SANITIZER)
#define ATTEND_ALLOCATION_FAULTS 0
#else
#define ATTEND_ALLOCATION_FAULTS 1
#endif

namespace attend::test {

inline std::atomic<size_t> g_fail_from{SIZE_MAX};
inline std::atomic<int64_t> g_failed_allocations{0};
constexpr bool kAllocationFaultsAvailable = ATTEND_ALLOCATION_FAULTS != 0;

inline bool injected_failure(size_t size) {
  if (size < g_fail_from.load(std::memory_order_relaxed)) return false;
  g_failed_allocations.fetch_add(1, std::memory_order_relaxed);
  errno = ENOMEM;
  return true;
}

// Fails every allocation of at least `bytes` while alive.
class AllocationFault {
 public:
  explicit AllocationFault(size_t bytes) { g_fail_from = bytes; }
  ~AllocationFault() { g_fail_from = SIZE_MAX; }
  AllocationFault(const AllocationFault&) = delete;
  AllocationFault& operator=(const AllocationFault&) = delete;
};

}  // namespace attend::test

#if ATTEND_ALLOCATION_FAULTS
extern "C" void* __libc_malloc(size_t size);
extern "C" void* __libc_memalign(size_t alignment, size_t size);

extern "C" void* malloc(size_t size) noexcept {
  return attend::test::injected_failure(size) ? nullptr : __libc_malloc(size);
}
extern "C" void* aligned_alloc(size_t alignment, size_t size) noexcept {
  return attend::test::injected_failure(size) ? nullptr : __libc_memalign(alignment, size);
}
#endif
