// module.cpp: the extension module attend._attend: exceptions, threads, what this build
// offers, and the C++-side timing loops of bench/python_bench.py (the C++ calls the Python
// calls are measured against, in the same process on the same arrays).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sched.h>

#include <atomic>
#include <cstdlib>
#include <ctime>
#include <optional>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "attend/error.hpp"
#include "attend/multihead.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "attend/sdpa_backward.hpp"
#include "bindings.hpp"

namespace attend_python {
namespace {

// Seconds from a start, of wall time or of this thread's CPU time (which a descheduled
// thread does not accumulate: the overhead of a one-thread call on a shared machine).
class Stopwatch {
 public:
  explicit Stopwatch(bool thread_cpu_time) : cpu_(thread_cpu_time), start_(now()) {}
  double seconds() const { return now() - start_; }

 private:
  double now() const {
    timespec t;
    clock_gettime(cpu_ ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
  }
  bool cpu_;
  double start_;
};

// 0: not set by attend.set_num_threads.
std::atomic<int> g_num_threads{0};

// OMP_NUM_THREADS when set, else the cores this process may run on. Fixed at import: the
// OpenMP default of the calling thread is not used, since importing torch sets it to
// torch's own thread count for the main thread only.
int default_num_threads() {
  static const int n = [] {
    if (const char* env = std::getenv("OMP_NUM_THREADS")) {
      const int parsed = std::atoi(env);
      if (parsed > 0) return parsed;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0)
      return CPU_COUNT(&set) > 0 ? CPU_COUNT(&set) : 1;
    return 1;
  }();
  return n;
}

PyObject* g_error = nullptr;        // attend.Error(ValueError)
PyObject* g_dtype_error = nullptr;  // attend.DTypeError(attend.Error, TypeError)

void set_num_threads(int n) {
  if (n < 0)
    throw attend::Error("num_threads must be >= 0 (0 = default), got " + std::to_string(n));
  g_num_threads = n;
}

// Seconds per call of the C++ API itself on borrowed arrays (no Python in the loop): the
// baseline of the Python call's overhead. With `out` None the call allocates its output
// (attend::scaled_dot_product_attention), else writes into `out` (..._into). Wall time, or
// the calling thread's CPU time.
double cpp_sdpa_seconds(py::handle query, py::handle key, py::handle value, py::handle out,
                        bool causal, int calls, int num_threads, bool thread_cpu_time) {
  const Borrowed q = borrow(query, "query"), k = borrow(key, "key"), v = borrow(value, "value");
  const std::optional<Borrowed> o =
      out.is_none() ? std::nullopt : std::optional<Borrowed>(borrow(out, "out", true));
  attend::AttentionOptions options;
  options.causal = causal;
  options.causal_alignment = attend::CausalAlignment::kTopLeft;
  options.num_threads = resolve_num_threads(num_threads);
  py::gil_scoped_release release;
  const auto call = [&] {
    if (o) {
      attend::scaled_dot_product_attention_into(q.view, k.view, v.view, o->view, nullptr, options);
    } else {
      attend::AttentionResult result =
          attend::scaled_dot_product_attention(q.view, k.view, v.view, options);
    }
  };
  call();
  const Stopwatch stopwatch(thread_cpu_time);
  for (int i = 0; i < calls; ++i) call();
  return stopwatch.seconds() / calls;
}

// Same for the forward with log-sum-exp plus the backward (both allocating their results, as
// attend's autograd function does).
double cpp_sdpa_forward_backward_seconds(py::handle query, py::handle key, py::handle value,
                                         py::handle grad_output, bool causal, int calls,
                                         int num_threads) {
  const Borrowed q = borrow(query, "query"), k = borrow(key, "key"), v = borrow(value, "value");
  const Borrowed d_o = borrow(grad_output, "grad_output");
  attend::AttentionOptions options;
  options.causal = causal;
  options.causal_alignment = attend::CausalAlignment::kTopLeft;
  options.num_threads = resolve_num_threads(num_threads);
  options.need_logsumexp = true;
  py::gil_scoped_release release;
  const auto call = [&] {
    const attend::AttentionResult forward =
        attend::scaled_dot_product_attention(q.view, k.view, v.view, options);
    const attend::AttentionGradients gradients = attend::scaled_dot_product_attention_backward(
        d_o.view, q.view, k.view, v.view, forward.output.view(), forward.logsumexp.view(), options);
  };
  call();
  const Stopwatch stopwatch(false);
  for (int i = 0; i < calls; ++i) call();
  return stopwatch.seconds() / calls;
}

// Seconds per forward of a C++ MultiHeadAttention (self-attention on x, no weights), of wall
// time or the calling thread's CPU time.
double cpp_multihead_seconds(const attend::MultiHeadAttention& module, py::handle x, int calls,
                             int num_threads, bool thread_cpu_time) {
  const Borrowed input = borrow(x, "x");
  attend::MultiHeadForwardOptions options;
  options.need_weights = false;
  options.num_threads = resolve_num_threads(num_threads);
  py::gil_scoped_release release;
  const auto call = [&] {
    const attend::MultiHeadResult r = module.forward(input.view, input.view, input.view, options);
  };
  call();
  const Stopwatch stopwatch(thread_cpu_time);
  for (int i = 0; i < calls; ++i) call();
  return stopwatch.seconds() / calls;
}

}  // namespace

void set_python_error(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const ArgumentTypeError& e) {
    PyErr_SetString(g_dtype_error, e.what());
  } catch (const attend::Error& e) {
    // A message about a dtype is a TypeError; every other a ValueError.
    const bool about_dtype = std::string(e.what()).find("dtype") != std::string::npos;
    PyErr_SetString(about_dtype ? g_dtype_error : g_error, e.what());
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

int resolve_num_threads(int requested) {
  if (requested > 0) return requested;
  const int set = g_num_threads.load(std::memory_order_relaxed);
  return set > 0 ? set : default_num_threads();
}

}  // namespace attend_python

PYBIND11_MODULE(_attend, m) {
  namespace py = pybind11;
  using namespace attend_python;
  m.doc() = "attend's C++ library; use the attend package, not this module";

  g_error = PyErr_NewExceptionWithDoc(
      "attend.Error", "attend's errors (a ValueError), with the C++ library's message.",
      PyExc_ValueError, nullptr);
  const py::tuple dtype_bases = py::make_tuple(py::handle(g_error), py::handle(PyExc_TypeError));
  g_dtype_error = PyErr_NewExceptionWithDoc(
      "attend.DTypeError", "A wrong dtype or argument type: an attend.Error and a TypeError.",
      dtype_bases.ptr(), nullptr);
  m.attr("Error") = py::handle(g_error);
  m.attr("DTypeError") = py::handle(g_dtype_error);
  // attend::Error keeps its message (set_python_error).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const attend::Error&) {
      set_python_error(std::current_exception());
    }
  });

  m.def("version", &attend::version, "attend's version, as `attend info` prints it");
  m.def("compiled_simd_targets", &attend::compiled_simd_targets,
        "The SIMD targets this build holds kernels for (e.g. [\"AVX3\", \"AVX2\", \"SSE4\", "
        "\"SCALAR\"])");
  m.def("supported_simd_targets", &attend::supported_simd_targets,
        "The compiled SIMD targets this CPU runs");
  m.def("active_simd_target", &attend::active_simd_target,
        "The SIMD target calls use now: the best supported one, capped by ATTEND_MAX_SIMD or "
        "set_max_simd_target");
  m.def("set_max_simd_target", &attend::set_max_simd_target, py::arg("name"),
        "Caps the SIMD target for this process (a name of compiled_simd_targets(), as "
        "ATTEND_MAX_SIMD); raises attend.Error for an unknown name");
  m.def("bf16_compute_path", &attend::bf16_compute_path,
        "How bfloat16 products are computed on this CPU (AMX, AVX512_BF16 or float32 "
        "emulation)");
  m.def("fp16_compute_path", &attend::fp16_compute_path,
        "How float16 products are computed on this CPU (AVX512_FP16 or float32 conversion)");
  m.def("runtime_report", &attend::runtime_report,
        "runtime_report() -> str: what `attend info` prints (version, SIMD targets, threads, "
        "reduced-precision paths)");
  m.def("set_num_threads", &set_num_threads, py::arg("num_threads"),
        "Threads for calls that do not name num_threads, process-wide; 0 restores the "
        "default (OMP_NUM_THREADS, else the cores this process may run on)");
  m.def(
      "get_num_threads", [] { return resolve_num_threads(0); },
      "Threads a call uses when it does not name num_threads");
  // How attend sees an array: (address, shape, strides in elements, dtype, "numpy" or
  // "torch"); the tests check it is the caller's memory, read in place.
  m.def(
      "view_of",
      [](py::handle array, bool writable) {
        const Borrowed b = borrow(array, "array", writable);
        std::vector<int64_t> shape(b.view.shape.data(), b.view.shape.data() + b.view.rank());
        std::vector<int64_t> strides(b.view.strides.data(), b.view.strides.data() + b.view.rank());
        return py::make_tuple(reinterpret_cast<uintptr_t>(b.view.data), shape, strides,
                              attend::dtype_name(b.view.dtype),
                              b.kind == Kind::kTorch ? "torch" : "numpy");
      },
      py::arg("array"), py::arg("writable"),
      "(address, shape, strides in elements, dtype, \"numpy\" or \"torch\") of the view attend "
      "reads of an array of any shape");
  m.def("cpp_sdpa_seconds", &cpp_sdpa_seconds, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("out"), py::arg("causal"), py::arg("calls"), py::arg("num_threads"),
        py::arg("thread_cpu_time"),
        "Seconds per C++ scaled_dot_product_attention (into out when not None) on query "
        "(..., H, Lq, E), key, value (..., H, Lk, E/Ev) in a C++ loop of `calls`");
  m.def("cpp_sdpa_forward_backward_seconds", &cpp_sdpa_forward_backward_seconds, py::arg("query"),
        py::arg("key"), py::arg("value"), py::arg("grad_output"), py::arg("causal"),
        py::arg("calls"), py::arg("num_threads"),
        "Seconds per C++ forward (with log-sum-exp) and backward on query (..., H, Lq, E), key, "
        "value (..., H, Lk, E/Ev), grad_output (..., H, Lq, Ev) in a C++ loop of `calls`");
  m.def("cpp_multihead_seconds", &cpp_multihead_seconds, py::arg("module"), py::arg("x"),
        py::arg("calls"), py::arg("num_threads"), py::arg("thread_cpu_time"),
        "Seconds per C++ MultiHeadAttention forward on x (N, L, E) (self-attention, no "
        "weights) in a C++ loop of `calls`");
  bind_sdpa(m);
  bind_modules(m);
  bind_serving(m);
}
