// device.cu: device guard and cached device properties.
#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <string_view>
#include <tuple>
#include <vector>

#include "cuda/common/check.cuh"
#include "cuda/common/step_grid.cuh"
#include "cuda/common/step_grid.h"
#include "cuda/common/tensor_map.cuh"
#include "cuda/norm/norm_cuda.h"
#include "fastweight/fastweight.h"

namespace fastweight {
namespace detail {
namespace {
constexpr int kMaxDevices = 64;
struct Props { int sms = 0, cc_major = 0; };
Props g_props[kMaxDevices];
std::once_flag g_once[kMaxDevices];

const Props& props() {
  int dev = 0;
  FW_CUDA_CHECK("fastweight", cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) throw Error(cat("fastweight: device index ", dev, " unsupported"));
  std::call_once(g_once[dev], [dev] {
    cudaDeviceProp prop{};
    FW_CUDA_CHECK("fastweight", cudaGetDeviceProperties(&prop, dev));
    g_props[dev].sms = prop.multiProcessorCount;
    g_props[dev].cc_major = prop.major;
  });
  return g_props[dev];
}
}  // namespace

bool set_step_tile_major(bool on) { return g_step_tile_major.exchange(on); }
bool set_step_vector_stores(bool on) { return g_step_vec_stores.exchange(on); }

int sm_count() { return props().sms; }
int cc_major() { return props().cc_major; }

cudaStream_t side_stream() {
  static std::mutex mu;
  static std::vector<cudaStream_t> streams;
  int dev = 0;
  FW_CUDA_CHECK("fastweight (side stream)", cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (streams.size() <= std::size_t(dev)) streams.resize(std::size_t(dev) + 1, nullptr);
  if (!streams[dev]) FW_CUDA_CHECK("fastweight (side stream)", cudaStreamCreateWithFlags(&streams[dev], cudaStreamNonBlocking));
  return streams[dev];
}

namespace {
bool encode_tile_map(CUtensorMapDataType dtype, CUtensorMap* map, const void* base, int rank, const std::uint64_t* dims,
                     const std::uint64_t* strides, const std::uint32_t* box, int swizzle) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return Encode(nullptr);
    }
    return reinterpret_cast<Encode>(fn);
  }();
  if (!encode || cc_major() < 9 || rank < 1 || rank > 5 || reinterpret_cast<std::uintptr_t>(base) % 16 != 0 ||
      (swizzle != 0 && swizzle != 64 && swizzle != 128))
    return false;
  for (int d = 0; d + 1 < rank; ++d)
    if (strides[d] % 16 != 0) return false;
  const cuuint32_t ones[5] = {1, 1, 1, 1, 1};
  return encode(map, dtype, cuuint32_t(rank), const_cast<void*>(base), dims, strides, box, ones,
                CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : swizzle == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_NONE,
                CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
}  // namespace

bool encode_bf16_tile_map(CUtensorMap* map, const void* base, int rank, const std::uint64_t* dims,
                          const std::uint64_t* strides, const std::uint32_t* box, int swizzle) {
  return encode_tile_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, map, base, rank, dims, strides, box, swizzle);
}

bool encode_f32_tile_map(CUtensorMap* map, const void* base, int rank, const std::uint64_t* dims,
                         const std::uint64_t* strides, const std::uint32_t* box) {
  return encode_tile_map(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, map, base, rank, dims, strides, box, 0);
}

int resident_ctas_per_sm(const void* kernel, int threads, std::size_t smem) {
  // Memoised per (device, kernel, threads, smem): the queries cost microseconds, the launches they
  // plan cost a few; the shared-memory limit is raised once per kernel and device.
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, std::size_t>, int> occ_cache;
  static std::map<std::pair<int, const void*>, std::size_t> smem_set;
  int dev = 0;
  FW_CUDA_CHECK("fastweight", cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(dev, kernel, threads, smem);
  if (auto it = occ_cache.find(key); it != occ_cache.end()) return it->second;
  std::size_t& raised = smem_set[{dev, kernel}];
  if (smem > raised && smem > 40 * 1024) {  // dynamic + static scratch may pass the 48 KB default
    FW_CUDA_CHECK("fastweight", cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    raised = smem;
  }
  int occ = 0;
  FW_CUDA_CHECK("fastweight", cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, threads, smem));
  occ_cache[key] = occ;
  return occ;
}

int resident_clusters(const void* kernel, int threads, std::size_t smem, int cluster) {
  if (resident_ctas_per_sm(kernel, threads, smem) == 0) return 0;  // (raises the shared-memory limit too)
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, std::size_t, int>, int> cache;
  int dev = 0;
  FW_CUDA_CHECK("fastweight", cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(dev, kernel, threads, smem, cluster);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(cluster) * unsigned(sm_count()));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(cluster);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int n = 0;
  FW_CUDA_CHECK("fastweight", cudaOccupancyMaxActiveClusters(&n, kernel, &cfg));
  cache[key] = n;
  return n;
}

namespace {
// FW_BUILD_ARCHS ("90a,80", CMake's list): does it name `arch` (a "-real" / "-virtual" suffix ignored)?
constexpr bool build_names_arch(std::string_view list, std::string_view arch) {
  while (!list.empty()) {
    const std::size_t comma = list.find(',');
    std::string_view a = list.substr(0, comma);
    if (const std::size_t dash = a.find('-'); dash != std::string_view::npos) a = a.substr(0, dash);
    if (a == arch) return true;
    list = comma == std::string_view::npos ? std::string_view{} : list.substr(comma + 1);
  }
  return false;
}
#if defined(FW_BUILD_ARCHS)
constexpr bool kBuiltSm90aOnly = build_names_arch(FW_BUILD_ARCHS, "90a") && !build_names_arch(FW_BUILD_ARCHS, "90");
#else
constexpr bool kBuiltSm90aOnly = false;
#endif
static_assert(build_names_arch("90a,80", "90a") && !build_names_arch("90a,80", "90") &&
              build_names_arch("80,90-real", "90") && !build_names_arch("", "90a"));
}  // namespace

bool kernel_runs_sm90a(const void* kernel) { return kBuiltSm90aOnly && kernel_binary_version(kernel) == 90; }

int kernel_binary_version(const void* kernel) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, int> cache;
  int dev = 0;
  FW_CUDA_CHECK("fastweight", cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find({dev, kernel}); it != cache.end()) return it->second;
  cudaFuncAttributes a{};
  FW_CUDA_CHECK("fastweight", cudaFuncGetAttributes(&a, kernel));
  // the PTX's architecture is what __CUDA_ARCH__ was (binaryVersion alone reports the device's for a
  // JIT-compiled PTX: compute_80 run on sm_100 would pass for 100)
  return cache[{dev, kernel}] = a.ptxVersion > 0 ? std::min(a.binaryVersion, a.ptxVersion) : a.binaryVersion;
}

namespace {
std::atomic<std::size_t> g_smem_optin_cap{0};  // 0: none (tests only: cap_smem_per_block_optin)
}

std::size_t smem_per_block_optin() {
  static std::mutex mu;
  static std::map<int, std::size_t> cache;
  int dev = 0;
  FW_CUDA_CHECK("fastweight", cudaGetDevice(&dev));
  std::size_t v = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(dev); it != cache.end()) {
      v = it->second;
    } else {
      int a = 0;
      FW_CUDA_CHECK("fastweight", cudaDeviceGetAttribute(&a, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
      v = cache[dev] = std::size_t(a);
    }
  }
  const std::size_t cap = g_smem_optin_cap.load();
  return cap ? std::min(v, cap) : v;
}

std::size_t cap_smem_per_block_optin(std::size_t bytes) { return g_smem_optin_cap.exchange(bytes); }

bool cuda_runtime_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
}

DeviceGuard::DeviceGuard(int device) {
  FW_CUDA_CHECK("fastweight", cudaGetDevice(&prev_));
  if (prev_ != device) FW_CUDA_CHECK("fastweight", cudaSetDevice(device));
  else prev_ = -1;
}
DeviceGuard::~DeviceGuard() {
  if (prev_ >= 0) (void)cudaSetDevice(prev_);
}
}  // namespace detail

bool cuda_available() { return detail::cuda_runtime_available(); }
}  // namespace fastweight
