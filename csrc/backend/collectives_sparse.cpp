// Backend: allreduce of sparse COO tensors (what DDP issues for the
// gradients of nn.Embedding(sparse=True)).
//
// The nonzeros of each rank differ in number and position, so this is not a
// ring reduction: every rank's coalesced (indices, values) are gathered around
// the ring, in three allgathers of one op (metadata, indices, values), and each
// rank sums them in rank order and coalesces. Every rank computes the same
// result from the same gathered bytes, so the result is identical everywhere.
#include <cstring>

#include "algorithms/algorithms.h"
#include "backend/backend.h"
#include "backend/validate.h"
#include "common/errors.h"

namespace ringreduce {
namespace {

// Per-rank metadata, gathered first: what the peers' blocks will hold, and
// the shape, which must agree (the header checks only the element count).
enum Meta : int64_t { kNnz, kSparseDim, kDenseDim, kDims, kSizesHash, kMetaLen };

int64_t sizesHash(at::IntArrayRef sizes) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the sizes
  for (int64_t s : sizes) {
    h = (h ^ static_cast<uint64_t>(s)) * 1099511628211ull;
  }
  return static_cast<int64_t>(h >> 1);
}

// Gathers a block of `counts[r]` elements of `elemSize` bytes from every rank
// into one flat buffer, rank 0's block first. `mine` is this rank's block.
at::Tensor gatherBlocks(const Comm& c, const at::Tensor& mine, const std::vector<size_t>& counts,
                        const at::TensorOptions& options) {
  size_t total = 0;
  for (size_t n : counts) total += n;
  at::Tensor flat = at::empty({static_cast<int64_t>(total)}, options);
  const size_t elemSize = flat.element_size();
  std::vector<char*> blocks(c.size);
  size_t offset = 0;
  for (int r = 0; r < c.size; ++r) {
    blocks[r] = static_cast<char*>(flat.data_ptr()) + offset * elemSize;
    offset += counts[r];
  }
  if (counts[c.rank] > 0) {
    std::memcpy(blocks[c.rank], mine.data_ptr(), counts[c.rank] * elemSize);
  }
  allgatherRing(c, blocks, counts, elemSize);
  return flat;
}

std::string shapeOf(int64_t sparseDim, int64_t denseDim, int64_t dims) {
  return std::to_string(dims) + " dims (" + std::to_string(sparseDim) + " sparse, " +
         std::to_string(denseDim) + " dense)";
}

}  // namespace

c10::intrusive_ptr<c10d::Work> Backend::allreduceSparse(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceOptions& opts) {
  OpContext ctx = nextContext("allreduce", tensors);
  const at::Tensor t = tensors[0];
  RR_CHECK_VALUE(t.device().is_cpu(), ctx, "input is ", describe(t),
                 ": sparse all-reduce runs on CPU tensors only (move it with .cpu())");
  RR_CHECK_VALUE(opts.reduceOp == c10d::ReduceOp::SUM || opts.reduceOp == c10d::ReduceOp::AVG,
                 ctx, "sparse all-reduce supports SUM and AVG only (input ", describe(t), ")");
  checkReduce(ctx, t.scalar_type(), opts.reduceOp);
  OpInfo op = makeOp(OpKind::kSparseAllreduce, "allreduce", t,
                     static_cast<uint8_t>(opts.reduceOp.op_), static_cast<uint64_t>(t.numel()));
  auto reduceOp = opts.reduceOp;
  return enqueue(
      std::move(op), opts.timeout, c10d::OpType::ALLREDUCE, tensors, opts.asyncOp,
      [t, reduceOp](const Comm& c) {
        const at::Tensor in = t.coalesce();
        const at::Tensor indices = in._indices().contiguous();
        const at::Tensor values = in._values().contiguous();
        const int64_t sizes = sizesHash(in.sizes());
        const at::Tensor meta = at::tensor(
            std::vector<int64_t>{in._nnz(), in.sparse_dim(), in.dense_dim(), in.dim(), sizes},
            at::kLong);
        const at::Tensor metas =
            gatherBlocks(c, meta, std::vector<size_t>(c.size, kMetaLen), at::kLong)
                .view({c.size, kMetaLen});
        const int64_t* m = metas.data_ptr<int64_t>();
        std::vector<size_t> indexCounts(c.size), valueCounts(c.size);
        int64_t rowNumel = 1;  // elements per nonzero: the dense dims
        for (int64_t d = 1; d < values.dim(); ++d) rowNumel *= values.size(d);
        int64_t total = 0;
        for (int r = 0; r < c.size; ++r) {
          const int64_t* mr = m + r * kMetaLen;
          if (mr[kSparseDim] != in.sparse_dim() || mr[kDenseDim] != in.dense_dim() ||
              mr[kDims] != in.dim() || mr[kSizesHash] != sizes) {
            const bool sameDims = mr[kSparseDim] == in.sparse_dim() &&
                                  mr[kDenseDim] == in.dense_dim() && mr[kDims] == in.dim();
            throwTransportError(c.op.ctx.message(
                "ranks disagree about the sparse tensor: rank " + std::to_string(r) + "'s tensor " +
                (sameDims ? "has other sizes than this rank's"
                          : "has " + shapeOf(mr[kSparseDim], mr[kDenseDim], mr[kDims]) +
                                ", this rank's has " +
                                shapeOf(in.sparse_dim(), in.dense_dim(), in.dim()))));
          }
          indexCounts[r] = static_cast<size_t>(mr[kNnz] * in.sparse_dim());
          valueCounts[r] = static_cast<size_t>(mr[kNnz] * rowNumel);
          total += mr[kNnz];
        }
        const at::Tensor allIndices = gatherBlocks(c, indices, indexCounts, at::kLong);
        const at::Tensor allValues = gatherBlocks(c, values, valueCounts, values.options());
        // Rank r's indices are a [sparse_dim, nnz_r] block: side by side in rank order.
        std::vector<at::Tensor> parts;
        int64_t offset = 0;
        for (int r = 0; r < c.size; ++r) {
          const int64_t nnz = m[r * kMetaLen + kNnz];
          parts.push_back(allIndices.narrow(0, offset, nnz * in.sparse_dim())
                              .view({in.sparse_dim(), nnz}));
          offset += nnz * in.sparse_dim();
        }
        std::vector<int64_t> valueShape{total};
        for (int64_t d = 1; d < values.dim(); ++d) valueShape.push_back(values.size(d));
        at::Tensor sum = at::sparse_coo_tensor(at::cat(parts, 1), allValues.view(valueShape),
                                               in.sizes(), values.options().layout(at::kSparse))
                             .coalesce();
        if (reduceOp.op_ == c10d::ReduceOp::AVG) sum = sum / c.size;
        t.copy_(sum);
      },
      {}, tensors);
}

}  // namespace ringreduce
