// DDTree: best-first draft-tree selection and retrieve/mask compile for one request.
//
// Plain C++ on purpose (no CUDA headers): the CUDA kernel in ddtree.cuh runs these
// functions on the device, and the overlay's CPU tests compile this same file with the host
// compiler to check it against the Python reference where no GPU exists.
//
// Semantics (DDTree, Ringel & Romano 2026; must equal ddtree_batched bit for bit):
//   log-probs are float64; a node's weight is formed root->leaf as parent + lp[d][rank]
//   (root weight 0.0); nodes are numbered in increasing key (-weight, rank tuple), ties
//   broken on the rank tuple lexicographically (a prefix sorts first). That is the order of
//   a best-first heap that pops (depth 1, rank 0) first and, per pop, pushes the next
//   sibling (rank + 1 < K) and the first child (depth < L).

#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define DDTREE_HD __host__ __device__ __forceinline__
#else
#define DDTREE_HD inline
#endif

namespace sglang {
namespace ddtree {

// Deepest tree the tie-break path buffers hold; the launcher rejects a deeper draft.
constexpr int kMaxDepth = 64;

// A heap entry: the node a pop would create. 16 bytes so B + 1 entries fit shared memory.
struct Candidate {
  double weight;
  int32_t parent;  // local node index of the parent (0 = root)
  int16_t depth;   // 1-based depth of the node itself
  int16_t rank;    // rank of the node's token among the top-K at its depth
};

// Where the selected nodes live (shared memory on the device). Index 0 is the root.
struct Nodes {
  double* weight;   // [N]
  int32_t* parent;  // [N], -1 for the root
  int16_t* depth;   // [N], 0 for the root
  int16_t* rank;    // [N], -1 for the root
};

// Rank path root->node of a candidate, written into `out`; returns its length.
DDTREE_HD int rank_path(const Nodes& nodes, const Candidate& c, int16_t* out) {
  int len = c.depth;
  out[len - 1] = c.rank;
  for (int n = c.parent, i = len - 2; n > 0; n = nodes.parent[n], --i) out[i] = nodes.rank[n];
  return len;
}

// True when `a` must pop before `b`: higher weight, or equal weight and smaller rank tuple.
DDTREE_HD bool pops_before(const Nodes& nodes, const Candidate& a, const Candidate& b) {
  if (a.weight != b.weight) return a.weight > b.weight;
  int16_t pa[kMaxDepth], pb[kMaxDepth];
  const int la = rank_path(nodes, a, pa);
  const int lb = rank_path(nodes, b, pb);
  const int common = la < lb ? la : lb;
  for (int i = 0; i < common; ++i) {
    if (pa[i] != pb[i]) return pa[i] < pb[i];
  }
  return la < lb;
}

DDTREE_HD void heap_push(const Nodes& nodes, Candidate* heap, int& size, const Candidate& c) {
  int i = size++;
  while (i > 0) {
    const int up = (i - 1) / 2;
    if (!pops_before(nodes, c, heap[up])) break;
    heap[i] = heap[up];
    i = up;
  }
  heap[i] = c;
}

DDTREE_HD Candidate heap_pop(const Nodes& nodes, Candidate* heap, int& size) {
  const Candidate top = heap[0];
  const Candidate last = heap[--size];
  int i = 0;
  while (true) {
    int child = 2 * i + 1;
    if (child >= size) break;
    if (child + 1 < size && pops_before(nodes, heap[child + 1], heap[child])) ++child;
    if (!pops_before(nodes, heap[child], last)) break;
    heap[i] = heap[child];
    i = child;
  }
  if (size > 0) heap[i] = last;
  return top;
}

// Best-first selection of up to `budget` nodes. lp is this request's [L, K] log-probs
// (row stride K). `heap` holds budget + 1 entries. Returns the node count (root excluded),
// which is below `budget` only when the draft has fewer than `budget` nodes.
DDTREE_HD int select_nodes(const double* lp, int L, int K, int budget, Nodes nodes, Candidate* heap) {
  nodes.weight[0] = 0.0;
  nodes.parent[0] = -1;
  nodes.depth[0] = 0;
  nodes.rank[0] = -1;
  int size = 0, count = 0;
  if (budget > 0 && L > 0 && K > 0) heap_push(nodes, heap, size, Candidate{0.0 + lp[0], 0, 1, 0});
  while (count < budget && size > 0) {
    const Candidate c = heap_pop(nodes, heap, size);
    const int n = ++count;
    nodes.weight[n] = c.weight;
    nodes.parent[n] = c.parent;
    nodes.depth[n] = c.depth;
    nodes.rank[n] = c.rank;
    if (c.rank + 1 < K) {
      const double w = nodes.weight[c.parent] + lp[(c.depth - 1) * K + c.rank + 1];
      heap_push(nodes, heap, size, Candidate{w, c.parent, c.depth, static_cast<int16_t>(c.rank + 1)});
    }
    if (c.depth < L) {
      const double w = c.weight + lp[c.depth * K];
      heap_push(nodes, heap, size, Candidate{w, n, static_cast<int16_t>(c.depth + 1), 0});
    }
  }
  return count;
}

// Retrieve links over local indices (-1 = none): first child and next sibling. Node order is
// key order, so a parent's children appear in sibling order; `last_child` is scratch [N].
DDTREE_HD void link_nodes(const Nodes& nodes, int count, int N, int32_t* last_child, int64_t* next_token,
                          int64_t* next_sibling) {
  for (int i = 0; i < N; ++i) {
    next_token[i] = -1;
    next_sibling[i] = -1;
    last_child[i] = -1;
  }
  for (int i = 1; i <= count; ++i) {
    const int p = nodes.parent[i];
    if (last_child[p] < 0) {
      next_token[p] = i;
    } else {
      next_sibling[last_child[p]] = i;
    }
    last_child[p] = i;
  }
}

// The builder outputs of slot i (< N), the ddtree_batched.DDTreeBatch contract: slots past
// `count` are padding (token, depth, parent, rank -1; weight -inf); slot 0 is the root
// (root_token, depth 0, parent -1, rank -1, weight 0.0).
DDTREE_HD void write_node(const Nodes& nodes, int i, int count, int K, const int64_t* ids, int64_t root_token,
                          int64_t* tokens, int64_t* depths, int64_t* parents, int64_t* ranks, double* weights) {
  if (i > count) {
    tokens[i] = depths[i] = parents[i] = ranks[i] = -1;
    weights[i] = -__builtin_huge_val();
    return;
  }
  const int d = nodes.depth[i];
  tokens[i] = i == 0 ? root_token : ids[(d - 1) * K + nodes.rank[i]];
  depths[i] = d;
  parents[i] = nodes.parent[i];
  ranks[i] = nodes.rank[i];
  weights[i] = nodes.weight[i];
}

// Verify position and global retrieve index of slot i. Padding slots sit at the root's
// position (prefix_len) and keep their global index b * N + i.
DDTREE_HD void write_verify_slot(const Nodes& nodes, int i, int count, int N, int64_t b, int64_t prefix_len,
                                 int64_t* positions, int64_t* retrieve_index) {
  positions[i] = prefix_len + (i <= count ? nodes.depth[i] : 0);
  retrieve_index[i] = b * N + i;
}

// Tree columns of mask row i: node i sees the root, its ancestors and itself. `row` points at
// the row's first tree column (after the prefix). A padding row sees the root and itself
// (never an empty row).
DDTREE_HD void write_mask_row(const Nodes& nodes, int i, int count, int N, bool* row) {
  for (int j = 0; j < N; ++j) row[j] = false;
  if (i > count) {
    row[0] = row[i] = true;
    return;
  }
  for (int n = i; n >= 0; n = nodes.parent[n]) row[n] = true;
}

}  // namespace ddtree
}  // namespace sglang
