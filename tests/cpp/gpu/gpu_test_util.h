// Shared helpers of the GPU test suites: skip without an sm_90 device, device buffers, downloads, CUDA graph capture.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "openvc/status.h"

namespace openvc::testing {

// Empty when a compute capability 9.0 device is current, else why not.
inline std::string missing_sm90() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("no usable CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(err) + ")";
  }
  if (count == 0) return "no CUDA device";
  int dev = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
    cudaGetLastError();
    return "cannot query the current CUDA device";
  }
  if (prop.major != 9 || prop.minor != 0)
    return std::string("device ") + prop.name + " is compute capability " + std::to_string(prop.major) + "." +
           std::to_string(prop.minor) + "; the kernels need 9.0 (sm_90a)";
  return "";
}

// Owning device allocation.
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t n = 0) : bytes(n) {
    if (n && cudaMalloc(&p, n) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

template <typename T>
std::vector<T> download(const void* p, size_t n) {
  std::vector<T> h(n);
  if (cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess) h.clear();
  return h;
}

template <typename T>
bool upload(void* dst, const std::vector<T>& src) {
  return cudaMemcpy(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess;
}

// A stream of the test's own with one capture of `enqueue(stream)` on it, instantiated; the test replays it with
// launch(). `status` is what `enqueue` returned (an openvc::Status), `error` the first CUDA error of the capture; check
// both before replaying. cudaStreamCaptureModeGlobal (the attention call's tests): the driver then refuses a
// synchronizing or allocating call from any thread, so one inside the library fails the capture.
struct CapturedGraph {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  openvc::Status status;
  cudaError_t error = cudaSuccess;
  template <class Enqueue>
  CapturedGraph(cudaStreamCaptureMode mode, Enqueue&& enqueue) {
    error = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (error == cudaSuccess) error = cudaStreamBeginCapture(stream, mode);
    if (error != cudaSuccess) return;
    status = std::forward<Enqueue>(enqueue)(stream);
    error = cudaStreamEndCapture(stream, &graph);
    if (error == cudaSuccess && status.ok()) error = cudaGraphInstantiate(&exec, graph, 0);
  }
  ~CapturedGraph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (stream) cudaStreamDestroy(stream);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  cudaError_t launch() const { return cudaGraphLaunch(exec, stream); }
};

}  // namespace openvc::testing

#define SKIP_WITHOUT_SM90()                                                    \
  do {                                                                         \
    const std::string _why = ::openvc::testing::missing_sm90();                \
    if (!_why.empty()) GTEST_SKIP() << "needs an sm_90a GPU: " << _why;        \
  } while (0)

#define CUDA_OK(expr) ASSERT_EQ(cudaSuccess, (expr)) << #expr << ": " << cudaGetErrorString(cudaGetLastError())
