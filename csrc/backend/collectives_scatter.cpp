// Backend: reduce-scatter and all-to-all.
#include <numeric>

#include "algorithms/algorithms.h"
#include "backend/device_stage.h"
#include "backend/backend.h"
#include "backend/validate.h"

namespace ringreduce {
namespace {

// Per-rank byte counts of an all-to-all buffer split along dim 0. Empty splits
// mean equal parts; otherwise there is one split per rank, summing to size(0).
std::vector<size_t> splitBytes(const OpContext& ctx, const at::Tensor& t,
                               const std::vector<int64_t>& splits, int size, const char* what) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const size_t rowBytes = rows == 0 ? 0 : nbytes(t) / static_cast<size_t>(rows);
  std::vector<size_t> bytes(size);
  if (splits.empty()) {
    RR_CHECK_VALUE(rows % size == 0, ctx, what, " dim 0 (", rows,
                   ") is not divisible by the world size ", size, " and no splits were given");
    std::fill(bytes.begin(), bytes.end(), static_cast<size_t>(rows / size) * rowBytes);
    return bytes;
  }
  RR_CHECK_VALUE(splits.size() == static_cast<size_t>(size), ctx, what, " splits have ",
                 splits.size(), " entries, expected ", size, " (one per rank)");
  int64_t sum = 0;
  for (int i = 0; i < size; ++i) {
    RR_CHECK_VALUE(splits[i] >= 0, ctx, what, " split ", i, " is negative (", splits[i], ")");
    sum += splits[i];
    bytes[i] = static_cast<size_t>(splits[i]) * rowBytes;
  }
  RR_CHECK_VALUE(sum == rows, ctx, what, " splits sum to ", sum, ", but dim 0 has ", rows,
                 " rows");
  return bytes;
}

// Ring reduce-scatter of `work` (a flat copy of every rank's n blocks, which
// it overwrites) into `out`, this rank's block.
void reduceScatterInto(const Comm& c, const at::Tensor& work, const at::Tensor& out, ReduceFn fn,
                       const c10d::ReduceOp& reduceOp) {
  auto blocks = equalBlocks(work, out.numel(), c.size);
  reduceScatterRing(c, blocksOf(blocks), std::vector<size_t>(c.size, static_cast<size_t>(out.numel())),
                    out.element_size(), fn);
  finishAverage(reduceOp, blocks[c.rank], c.size);
  out.copy_(blocks[c.rank].view(out.sizes()));
}

std::vector<size_t> offsetsOf(const std::vector<size_t>& bytes) {
  std::vector<size_t> offsets(bytes.size(), 0);
  std::partial_sum(bytes.begin(), bytes.end() - 1, offsets.begin() + 1);
  return offsets;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) try {
  OpContext ctx = nextContext("reduce_scatter", outputs);
  const at::Tensor out = single(ctx, outputs, "output");
  RR_CHECK_VALUE(inputs.size() == 1, ctx, "expected one input list, got ", inputs.size());
  checkList(ctx, inputs[0], getSize(), out.scalar_type(), out.numel(), "input");
  checkWritable(ctx, out, "output");
  ReduceFn fn = checkReduce(ctx, out.scalar_type(), opts.reduceOp);
  auto reduceOp = opts.reduceOp;
  std::vector<at::Tensor> all = inputs[0];
  all.push_back(out);
  DeviceStage stage = DeviceStage::begin(ctx, all);
  OpInfo op = makeOp(OpKind::kReduceScatter, "reduce_scatter", out,
                     static_cast<uint8_t>(opts.reduceOp.op_), out.numel());
  std::vector<at::Tensor> ins = stage.in(inputs[0]);
  at::Tensor h = stage.out(out);
  return enqueue(std::move(op), opts.timeout, c10d::OpType::REDUCE_SCATTER, outputs, opts.asyncOp,
                 [ins, out = h, fn, reduceOp](const Comm& c) {
                   std::vector<at::Tensor> flat;
                   for (const auto& t : ins) flat.push_back(t.reshape(-1));
                   reduceScatterInto(c, at::cat(flat), out, fn, reduceOp);
                 },
                 std::move(stage), inputs[0]);
} RR_REJECTED_AT_CALL

c10::intrusive_ptr<c10d::Work> Backend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) try {
  OpContext ctx = nextContext("reduce_scatter_tensor", input);
  checkTensor(ctx, output, "output");
  checkLike(ctx, input, output.scalar_type(), output.numel() * getSize(),
            "input (world size x output)");
  checkWritable(ctx, output, "output");
  ReduceFn fn = checkReduce(ctx, output.scalar_type(), opts.reduceOp);
  auto reduceOp = opts.reduceOp;
  DeviceStage stage = DeviceStage::begin(ctx, {input, output});
  OpInfo op = makeOp(OpKind::kReduceScatter, "reduce_scatter_tensor", output,
                     static_cast<uint8_t>(opts.reduceOp.op_), output.numel());
  at::Tensor in = stage.in(input), out = stage.out(output);
  return enqueue(std::move(op), opts.timeout, c10d::OpType::_REDUCE_SCATTER_BASE, {output}, opts.asyncOp,
                 [in, out, fn, reduceOp](const Comm& c) {
                   reduceScatterInto(c, in.reshape(-1).clone(), out, fn, reduceOp);
                 },
                 std::move(stage), {input});
} RR_REJECTED_AT_CALL

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) try {
  OpContext ctx = nextContext("reduce_scatter_tensor_coalesced", inputs);
  const int64_t total = checkCoalescedPairs(ctx, outputs, "output", inputs, "input", getSize());
  for (size_t j = 0; j < outputs.size(); ++j) {
    checkWritable(ctx, outputs[j], "output " + std::to_string(j));
  }
  ReduceFn fn = checkReduce(ctx, outputs[0].scalar_type(), opts.reduceOp);
  auto reduceOp = opts.reduceOp;
  std::vector<at::Tensor> all = outputs;
  all.insert(all.end(), inputs.begin(), inputs.end());
  DeviceStage stage = DeviceStage::begin(ctx, all);
  OpInfo op = makeOp(OpKind::kReduceScatter, "reduce_scatter_tensor_coalesced", outputs[0],
                     static_cast<uint8_t>(opts.reduceOp.op_), total);
  std::vector<at::Tensor> ins = stage.in(inputs), outs = stage.out(outputs);
  return enqueue(std::move(op), opts.timeout, kReduceScatterCoalescedType, outputs,
                 opts.asyncOp,
                 [ins, outs, total, fn, reduceOp](const Comm& c) {
                   // Block r (what rank r ends with) is every input's slice r
                   // end to end.
                   std::vector<at::Tensor> pieces;
                   for (int r = 0; r < c.size; ++r) {
                     for (size_t j = 0; j < ins.size(); ++j) {
                       const int64_t n = outs[j].numel();
                       pieces.push_back(ins[j].reshape(-1).narrow(0, r * n, n));
                     }
                   }
                   at::Tensor mine = at::empty({total}, outs[0].options());
                   reduceScatterInto(c, at::cat(pieces), mine, fn, reduceOp);
                   int64_t offset = 0;
                   for (const auto& o : outs) {
                     o.copy_(mine.narrow(0, offset, o.numel()).view(o.sizes()));
                     offset += o.numel();
                   }
                 },
                 std::move(stage), inputs);
} RR_REJECTED_AT_CALL

c10::intrusive_ptr<c10d::Work> Backend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                          std::vector<int64_t>& outputSplits,
                                                          std::vector<int64_t>& inputSplits,
                                                          const c10d::AllToAllOptions& opts) try {
  OpContext ctx = nextContext("alltoall_base", input);
  checkTensor(ctx, input, "input");
  checkWritable(ctx, output, "output");
  RR_CHECK_VALUE(input.scalar_type() == output.scalar_type(), ctx, "output dtype ",
                 dtypeName(output.scalar_type()), " differs from input dtype ",
                 dtypeName(input.scalar_type()));
  auto sendBytes = splitBytes(ctx, input, inputSplits, getSize(), "input");
  auto recvBytes = splitBytes(ctx, output, outputSplits, getSize(), "output");
  RR_CHECK_VALUE(sendBytes[getRank()] == recvBytes[getRank()], ctx, "this rank sends itself ",
                 sendBytes[getRank()], " bytes but expects ", recvBytes[getRank()]);
  // Per-peer sizes differ legitimately, so `total` is unchecked; the header's
  // byte count still catches splits that disagree across ranks.
  DeviceStage stage = DeviceStage::begin(ctx, {input, output});
  OpInfo op = makeOp(OpKind::kAlltoall, "alltoall_base", input, kNoReduceOp, kUnchecked);
  at::Tensor in = stage.in(input), out = stage.out(output);
  return enqueue(std::move(op), opts.timeout, c10d::OpType::ALLTOALL_BASE, {output}, opts.asyncOp,
                 [in, out, sendBytes, recvBytes](const Comm& c) {
                   // In place (all_to_all_single(x, x)): a block received
                   // early would overwrite one still to be sent.
                   at::Tensor sIn = overlapping(in, {out}) ? in.contiguous().clone() : staged(in);
                   at::Tensor sOut = staged(out);
                   auto sendOff = offsetsOf(sendBytes), recvOff = offsetsOf(recvBytes);
                   std::vector<const char*> sendPtrs;
                   std::vector<char*> recvPtrs;
                   for (int i = 0; i < c.size; ++i) {
                     sendPtrs.push_back(bytesOf(sIn) + sendOff[i]);
                     recvPtrs.push_back(bytesOf(sOut) + recvOff[i]);
                   }
                   alltoallPairwise(c, sendPtrs, sendBytes, recvPtrs, recvBytes);
                   writeBack(out, sOut);
                 },
                 std::move(stage), {input});
} RR_REJECTED_AT_CALL

c10::intrusive_ptr<c10d::Work> Backend::alltoall(std::vector<at::Tensor>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions& opts) try {
  OpContext ctx = nextContext("alltoall", inputs);
  RR_CHECK_VALUE(inputs.size() == static_cast<size_t>(getSize()) &&
                     outputs.size() == static_cast<size_t>(getSize()),
                 ctx, "expected ", getSize(), " input and output tensors (one per rank), got ",
                 inputs.size(), " and ", outputs.size());
  std::vector<size_t> sendBytes, recvBytes;
  for (int i = 0; i < getSize(); ++i) {
    checkLike(ctx, inputs[i], inputs[0].scalar_type(), inputs[i].numel(),
              "input " + std::to_string(i));
    checkLike(ctx, outputs[i], inputs[0].scalar_type(), outputs[i].numel(),
              "output " + std::to_string(i));
    checkWritable(ctx, outputs[i], "output " + std::to_string(i));
    sendBytes.push_back(nbytes(inputs[i]));
    recvBytes.push_back(nbytes(outputs[i]));
  }
  RR_CHECK_VALUE(inputs[getRank()].numel() == outputs[getRank()].numel(), ctx,
                 "input and output ", getRank(), " (this rank's own) differ in size");
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  DeviceStage stage = DeviceStage::begin(ctx, all);
  OpInfo op = makeOp(OpKind::kAlltoall, "alltoall", inputs[0], kNoReduceOp, kUnchecked);
  std::vector<at::Tensor> ins = stage.in(inputs);
  std::vector<at::Tensor> outs = stage.out(outputs);
  return enqueue(std::move(op), opts.timeout, c10d::OpType::ALLTOALL, outputs, opts.asyncOp,
                 [ins, outs, sendBytes, recvBytes](const Comm& c) {
                   std::vector<at::Tensor> sIn, sOut;
                   std::vector<const char*> sendPtrs;
                   std::vector<char*> recvPtrs;
                   for (int i = 0; i < c.size; ++i) {
                     // An input that is also an output (all_to_all(ts, ts)) may
                     // be overwritten before it is sent: sent from a copy.
                     sIn.push_back(overlapping(ins[i], outs) ? ins[i].contiguous().clone()
                                                             : staged(ins[i]));
                     sOut.push_back(staged(outs[i]));
                     sendPtrs.push_back(bytesOf(sIn[i]));
                     recvPtrs.push_back(bytesOf(sOut[i]));
                   }
                   alltoallPairwise(c, sendPtrs, sendBytes, recvPtrs, recvBytes);
                   for (int i = 0; i < c.size; ++i) writeBack(outs[i], sOut[i]);
                 },
                 std::move(stage), inputs);
} RR_REJECTED_AT_CALL

}  // namespace ringreduce
