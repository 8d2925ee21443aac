// DDTree draft-tree build on the GPU: one thread block per request.
//
// Thread 0 runs the best-first selection (ddtree_core.cuh) over a heap in shared memory and
// links the retrieve arrays; then the whole block writes the per-node outputs and the
// FULL_MASK rows. Outputs equal sglang.srt.speculative.ddtree_batched exactly (float64
// weights, same node order, ties and padding).
//
// Shapes (bs requests, L depths, K top-k, B budget, N = B + 1 nodes incl. the root):
//   in:   log_probs [bs, L, K] float64, token_ids [bs, L, K] int64, root_tokens [bs] int64
//   tree: tokens / depths / parents / ranks [bs, N] int64, node_logws [bs, N] float64
//   verify (optional): prefix_lens / mask_offsets [bs] int64, positions [bs * N] int64,
//         retrieve_index / retrieve_next_token / retrieve_next_sibling [bs, N] int64,
//         tree_mask 1-byte elements, FULL_MASK: request b's N x (prefix_len + N) rows start at
//         mask_offsets[b]. Pass an empty tree_mask to skip the verify outputs. A request whose
//         block would end past tree_mask.numel() traps (the launch fails) instead of writing.

#pragma once

#include <sgl_kernel/tensor.h>

#include <sgl_kernel/utils.cuh>

#include "ddtree_core.cuh"

namespace sglang {
namespace ddtree {

constexpr int kThreads = 256;
constexpr int64_t kMaxBudget = 1024;

// Shared-memory layout of one block, 16-byte aligned parts first.
struct SmemLayout {
  int64_t n;
  __host__ __device__ explicit SmemLayout(int64_t num_nodes) : n(num_nodes) {}
  __host__ __device__ size_t heap_offset() const { return 0; }
  __host__ __device__ size_t weight_offset() const { return sizeof(Candidate) * n; }
  __host__ __device__ size_t parent_offset() const { return weight_offset() + sizeof(double) * n; }
  __host__ __device__ size_t last_child_offset() const { return parent_offset() + sizeof(int32_t) * n; }
  __host__ __device__ size_t depth_offset() const { return last_child_offset() + sizeof(int32_t) * n; }
  __host__ __device__ size_t rank_offset() const { return depth_offset() + sizeof(int16_t) * n; }
  __host__ __device__ size_t bytes() const { return rank_offset() + sizeof(int16_t) * n; }
};

__global__ void __launch_bounds__(kThreads) build_ddtree_kernel(
    const double* __restrict__ log_probs,
    const int64_t* __restrict__ token_ids,
    const int64_t* __restrict__ root_tokens,
    int64_t* __restrict__ tokens,
    int64_t* __restrict__ depths,
    int64_t* __restrict__ parents,
    int64_t* __restrict__ ranks,
    double* __restrict__ node_logws,
    // Verify inputs; all null when only the tree is wanted (ddtree_batched's extension point).
    const int64_t* __restrict__ prefix_lens,
    const int64_t* __restrict__ mask_offsets,
    int64_t* __restrict__ positions,
    int64_t* __restrict__ retrieve_index,
    int64_t* __restrict__ retrieve_next_token,
    int64_t* __restrict__ retrieve_next_sibling,
    bool* __restrict__ tree_mask,
    int64_t mask_capacity,
    int L,
    int K,
    int budget) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_count;
  const int N = budget + 1;
  const int64_t b = blockIdx.x;
  const SmemLayout layout(N);
  Candidate* heap = reinterpret_cast<Candidate*>(smem + layout.heap_offset());
  int32_t* last_child = reinterpret_cast<int32_t*>(smem + layout.last_child_offset());
  const Nodes nodes{
      reinterpret_cast<double*>(smem + layout.weight_offset()),
      reinterpret_cast<int32_t*>(smem + layout.parent_offset()),
      reinterpret_cast<int16_t*>(smem + layout.depth_offset()),
      reinterpret_cast<int16_t*>(smem + layout.rank_offset())};
  const int64_t row = b * N;

  if (threadIdx.x == 0) {
    s_count = select_nodes(log_probs + b * L * K, L, K, budget, nodes, heap);
  }
  __syncthreads();
  const int count = s_count;
  const int64_t root_token = root_tokens[b];
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    write_node(
        nodes, i, count, K, token_ids + b * L * K, root_token, tokens + row, depths + row, parents + row,
        ranks + row, node_logws + row);
  }
  if (tree_mask == nullptr) return;

  if (threadIdx.x == 0) {
    link_nodes(nodes, count, N, last_child, retrieve_next_token + row, retrieve_next_sibling + row);
  }
  const int64_t prefix_len = prefix_lens[b];
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    write_verify_slot(nodes, i, count, N, b, prefix_len, positions + row, retrieve_index + row);
  }
  // FULL_MASK: every row sees the whole prefix; its tree columns follow the prefix.
  const int64_t stride = prefix_len + N;
  if (mask_offsets[b] + N * stride > mask_capacity) {
    // The host's mask bound was below sum_b N * (prefix_b + N): writing would run past the
    // buffer. Abort the launch (an error at the next sync) rather than corrupt memory.
    __trap();
  }
  bool* mask = tree_mask + mask_offsets[b];
  for (int64_t idx = threadIdx.x; idx < prefix_len * N; idx += blockDim.x) {
    mask[(idx / prefix_len) * stride + idx % prefix_len] = true;
  }
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    write_mask_row(nodes, i, count, N, mask + i * stride + prefix_len);
  }
}

}  // namespace ddtree

/// \brief Build DDTree draft trees in place: the tree only (verify outputs all empty), or
/// the tree plus its verify inputs (positions, retrieve arrays, FULL_MASK).
inline void build_ddtree(
    tvm::ffi::TensorView log_probs,
    tvm::ffi::TensorView token_ids,
    tvm::ffi::TensorView root_tokens,
    tvm::ffi::TensorView tokens,
    tvm::ffi::TensorView depths,
    tvm::ffi::TensorView parents,
    tvm::ffi::TensorView ranks,
    tvm::ffi::TensorView node_logws,
    tvm::ffi::TensorView prefix_lens,
    tvm::ffi::TensorView mask_offsets,
    tvm::ffi::TensorView positions,
    tvm::ffi::TensorView retrieve_index,
    tvm::ffi::TensorView retrieve_next_token,
    tvm::ffi::TensorView retrieve_next_sibling,
    tvm::ffi::TensorView tree_mask,
    int64_t budget) {
  using namespace host;
  SymbolicSize batch_size{"batch_size"}, depth{"depth"}, topk{"topk"};
  SymbolicDevice device;
  RuntimeCheck(budget >= 0 && budget <= ddtree::kMaxBudget, "DDTree budget must be in [0, 1024], got ", budget);
  const int64_t num_nodes = budget + 1;
  TensorMatcher({batch_size, depth, topk}).with_dtype<double>().with_device<kDLGPU>(device).verify(log_probs);
  TensorMatcher({batch_size, depth, topk}).with_dtype<int64_t>().with_device(device).verify(token_ids);
  TensorMatcher({batch_size}).with_dtype<int64_t>().with_device(device).verify(root_tokens);
  TensorMatcher({batch_size, num_nodes})
      .with_dtype<int64_t>()
      .with_device(device)
      .verify(tokens)
      .verify(depths)
      .verify(parents)
      .verify(ranks);
  TensorMatcher({batch_size, num_nodes}).with_dtype<double>().with_device(device).verify(node_logws);
  RuntimeCheck(depth.unwrap() <= ddtree::kMaxDepth, "DDTree depth must be <= 64, got ", depth.unwrap());
  RuntimeCheck(topk.unwrap() <= 32767, "DDTree topk must fit int16, got ", topk.unwrap());
  const int64_t bs = batch_size.unwrap();
  const bool with_verify = tree_mask.numel() > 0;
  if (with_verify) {
    TensorMatcher({batch_size}).with_dtype<int64_t>().with_device(device).verify(prefix_lens).verify(mask_offsets);
    TensorMatcher({batch_size, num_nodes})
        .with_dtype<int64_t>()
        .with_device(device)
        .verify(retrieve_index)
        .verify(retrieve_next_token)
        .verify(retrieve_next_sibling);
    TensorMatcher({bs * num_nodes}).with_dtype<int64_t>().with_device(device).verify(positions);
    // Raw bytes to the kernel (bool or uint8); its extent depends on the prefix lengths.
    TensorMatcher({-1}).with_device(device).verify(tree_mask);
    RuntimeCheck(tree_mask.dtype().bits == 8, "DDTree tree_mask must have 1-byte elements");
  }
  if (bs == 0) return;

  auto ptr = [with_verify](tvm::ffi::TensorView t) { return with_verify ? static_cast<int64_t*>(t.data_ptr()) : nullptr; };
  const size_t smem = ddtree::SmemLayout(num_nodes).bytes();
  LaunchKernel(static_cast<uint32_t>(bs), ddtree::kThreads, device.unwrap(), smem)(
      ddtree::build_ddtree_kernel,
      static_cast<const double*>(log_probs.data_ptr()),
      static_cast<const int64_t*>(token_ids.data_ptr()),
      static_cast<const int64_t*>(root_tokens.data_ptr()),
      static_cast<int64_t*>(tokens.data_ptr()),
      static_cast<int64_t*>(depths.data_ptr()),
      static_cast<int64_t*>(parents.data_ptr()),
      static_cast<int64_t*>(ranks.data_ptr()),
      static_cast<double*>(node_logws.data_ptr()),
      static_cast<const int64_t*>(ptr(prefix_lens)),
      static_cast<const int64_t*>(ptr(mask_offsets)),
      ptr(positions),
      ptr(retrieve_index),
      ptr(retrieve_next_token),
      ptr(retrieve_next_sibling),
      with_verify ? static_cast<bool*>(tree_mask.data_ptr()) : nullptr,
      static_cast<int64_t>(tree_mask.numel()),
      static_cast<int>(depth.unwrap()),
      static_cast<int>(topk.unwrap()),
      static_cast<int>(budget));
}

}  // namespace sglang
