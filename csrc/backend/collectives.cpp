// Backend collective methods: validate, describe, build the Work, enqueue.
// The closures stage non-contiguous tensors into contiguous buffers, run an
// algorithm, and write results back into the caller's tensors.
#include <numeric>

#include "algorithms/algorithms.h"
#include "backend/device_stage.h"
#include "backend/backend.h"
#include "backend/validate.h"

namespace ringreduce {
namespace {

using c10d::OpType;

uint8_t wireOp(const c10d::ReduceOp& op) {
  return static_cast<uint8_t>(op.op_);
}

std::vector<at::Tensor> stagedAll(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(staged(t));
  return out;
}

void writeBackAll(const std::vector<at::Tensor>& ts, const std::vector<at::Tensor>& s) {
  for (size_t i = 0; i < ts.size(); ++i) writeBack(ts[i], s[i]);
}

// One flat contiguous tensor holding every tensor of the list, in order.
at::Tensor flatten(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> flat;
  for (const auto& t : ts) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

// Ring allgather of every rank's inputs laid end to end (`total` elements):
// block r holds rank r's.
std::vector<at::Tensor> allgatherFlat(const Comm& c, const std::vector<at::Tensor>& ins,
                                      int64_t total) {
  at::Tensor buf = at::empty({total * c.size}, ins[0].options());
  auto blocks = equalBlocks(buf, total, c.size);
  blocks[c.rank].copy_(flatten(ins));
  allgatherRing(c, blocksOf(blocks), std::vector<size_t>(c.size, static_cast<size_t>(total)),
                ins[0].element_size());
  return blocks;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> Backend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) try {
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) {
    return allreduceSparse(tensors, opts);
  }
  OpContext ctx = nextContext("allreduce", tensors);
  const at::Tensor t = single(ctx, tensors, "input");
  checkWritable(ctx, t, "input");
  ReduceFn fn = checkReduce(ctx, t.scalar_type(), opts.reduceOp);
  auto reduceOp = opts.reduceOp;
  DeviceStage stage = DeviceStage::begin(ctx, tensors);
  OpInfo op = makeOp(OpKind::kAllreduce, "allreduce", t, wireOp(opts.reduceOp), t.numel());
  at::Tensor h = stage.inout(t);
  return enqueue(std::move(op), opts.timeout, OpType::ALLREDUCE, tensors, opts.asyncOp,
                 [h, fn, reduceOp](const Comm& c) {
                   at::Tensor s = staged(h);
                   allreduceAuto(c, bytesOf(s), s.numel(), s.element_size(), fn);
                   finishAverage(reduceOp, s, c.size);
                   writeBack(h, s);
                 },
                 std::move(stage));
} RR_REJECTED_AT_CALL

c10::intrusive_ptr<c10d::Work> Backend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) try {
  OpContext ctx = nextContext("allreduce_coalesced", tensors);
  RR_CHECK_VALUE(!tensors.empty(), ctx, "needs at least one tensor");
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    checkLike(ctx, tensors[i], tensors[0].scalar_type(), tensors[i].numel(),
              "tensor " + std::to_string(i));
    checkWritable(ctx, tensors[i], "tensor " + std::to_string(i));
    total += tensors[i].numel();
  }
  ReduceFn fn = checkReduce(ctx, tensors[0].scalar_type(), opts.reduceOp);
  auto reduceOp = opts.reduceOp;
  DeviceStage stage = DeviceStage::begin(ctx, tensors);
  OpInfo op = makeOp(OpKind::kAllreduce, "allreduce_coalesced", tensors[0],
                     wireOp(opts.reduceOp), total);
  std::vector<at::Tensor> ts = stage.inout(tensors);
  return enqueue(std::move(op), opts.timeout, OpType::ALLREDUCE_COALESCED, tensors, opts.asyncOp,
                 [ts, fn, reduceOp](const Comm& c) {
                   at::Tensor flat = flatten(ts);
                   allreduceAuto(c, bytesOf(flat), flat.numel(), flat.element_size(), fn);
                   finishAverage(reduceOp, flat, c.size);
                   int64_t offset = 0;
                   for (const auto& t : ts) {
                     t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
                     offset += t.numel();
                   }
                 },
                 std::move(stage));
} RR_REJECTED_AT_CALL

c10::intrusive_ptr<c10d::Work> Backend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) try {
  OpContext ctx = nextContext("broadcast", tensors);
  const at::Tensor t = single(ctx, tensors, "input");
  checkRoot(ctx, opts.rootRank, getSize(), "root rank");
  RR_CHECK_VALUE(opts.rootTensor == 0, ctx, "rootTensor must be 0, got ", opts.rootTensor);
  int root = static_cast<int>(opts.rootRank);
  if (getRank() != root) roleChecks(ctx, root, [&] { checkWritable(ctx, t, "input"); });
  DeviceStage stage = DeviceStage::begin(ctx, tensors);
  OpInfo op = makeOp(OpKind::kBroadcast, "broadcast", t, kNoReduceOp, t.numel(), root);
  at::Tensor h = getRank() == root ? stage.in(t) : stage.out(t);
  return enqueue(std::move(op), opts.timeout, OpType::BROADCAST, tensors, opts.asyncOp,
                 [h, root](const Comm& c) {
                   at::Tensor s = staged(h);
                   broadcastAuto(c, bytesOf(s), nbytes(s), root);
                   // The root's tensor is only read: it may be expanded, or an
                   // inference tensor this worker may not write.
                   if (c.rank != root) writeBack(h, s);
                 },
                 std::move(stage));
} RR_REJECTED_AT_CALL

c10::intrusive_ptr<c10d::Work> Backend::reduce(std::vector<at::Tensor>& tensors,
                                                   const c10d::ReduceOptions& opts) try {
  OpContext ctx = nextContext("reduce", tensors);
  const at::Tensor t = single(ctx, tensors, "input");
  checkRoot(ctx, opts.rootRank, getSize(), "root rank");
  ReduceFn fn = checkReduce(ctx, t.scalar_type(), opts.reduceOp);
  int root = static_cast<int>(opts.rootRank);
  if (getRank() == root) roleChecks(ctx, root, [&] { checkWritable(ctx, t, "input"); });
  auto reduceOp = opts.reduceOp;
  DeviceStage stage = DeviceStage::begin(ctx, tensors);
  OpInfo op = makeOp(OpKind::kReduce, "reduce", t, wireOp(opts.reduceOp), t.numel(), root);
  at::Tensor h = getRank() == root ? stage.inout(t) : stage.in(t);
  return enqueue(std::move(op), opts.timeout, OpType::REDUCE, tensors, opts.asyncOp,
                 [h, fn, root, reduceOp](const Comm& c) {
                   // Non-roots work on a copy: their input stays as it was.
                   at::Tensor s = c.rank == root ? staged(h) : h.contiguous().clone();
                   reduceRing(c, bytesOf(s), s.numel(), s.element_size(), fn, root);
                   if (c.rank == root) {
                     finishAverage(reduceOp, s, c.size);
                     writeBack(h, s);
                   }
                 },
                 std::move(stage));
} RR_REJECTED_AT_CALL

c10::intrusive_ptr<c10d::Work> Backend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) try {
  OpContext ctx = nextContext("allgather", inputs);
  const at::Tensor in = single(ctx, inputs, "input");
  RR_CHECK_VALUE(outputs.size() == 1, ctx, "expected one output list, got ", outputs.size());
  checkList(ctx, outputs[0], getSize(), in.scalar_type(), in.numel(), "output");
  for (const auto& t : outputs[0]) checkWritable(ctx, t, "output tensor");
  std::vector<at::Tensor> all = outputs[0];
  all.push_back(in);
  DeviceStage stage = DeviceStage::begin(ctx, all);
  OpInfo op = makeOp(OpKind::kAllgather, "allgather", in, kNoReduceOp, in.numel());
  std::vector<at::Tensor> outs = stage.out(outputs[0]);
  at::Tensor h = stage.in(in);
  return enqueue(std::move(op), opts.timeout, OpType::ALLGATHER, outputs[0], opts.asyncOp,
                 [in = h, outs](const Comm& c) {
                   auto s = stagedAll(outs);
                   s[c.rank].view(-1).copy_(in.reshape(-1));
                   std::vector<size_t> counts(c.size, static_cast<size_t>(in.numel()));
                   allgatherRing(c, blocksOf(s), counts, in.element_size());
                   writeBackAll(outs, s);
                 },
                 std::move(stage), inputs);
} RR_REJECTED_AT_CALL

c10::intrusive_ptr<c10d::Work> Backend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) try {
  OpContext ctx = nextContext("allgather_into_tensor", input);
  checkTensor(ctx, input, "input");
  checkLike(ctx, output, input.scalar_type(), input.numel() * getSize(),
            "output (world size x input)");
  checkWritable(ctx, output, "output");
  DeviceStage stage = DeviceStage::begin(ctx, {input, output});
  OpInfo op = makeOp(OpKind::kAllgather, "allgather_into_tensor", input, kNoReduceOp,
                     input.numel());
  at::Tensor in = stage.in(input), out = stage.out(output);
  return enqueue(std::move(op), opts.timeout, OpType::_ALLGATHER_BASE, {output}, opts.asyncOp,
                 [in, out](const Comm& c) {
                   at::Tensor s = staged(out);
                   size_t count = static_cast<size_t>(in.numel());
                   auto blocks = equalBlocks(s, in.numel(), c.size);
                   blocks[c.rank].copy_(in.reshape(-1));
                   allgatherRing(c, blocksOf(blocks), std::vector<size_t>(c.size, count),
                                 in.element_size());
                   writeBack(out, s);
                 },
                 std::move(stage), {input});
} RR_REJECTED_AT_CALL

c10::intrusive_ptr<c10d::Work> Backend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) try {
  OpContext ctx = nextContext("allgather_coalesced", inputs);
  RR_CHECK_VALUE(!inputs.empty(), ctx, "needs at least one input tensor");
  RR_CHECK_VALUE(outputLists.size() == static_cast<size_t>(getSize()), ctx, "expected ",
                 getSize(), " output lists (one per rank), got ", outputLists.size());
  int64_t total = 0;
  for (size_t j = 0; j < inputs.size(); ++j) {
    checkLike(ctx, inputs[j], inputs[0].scalar_type(), inputs[j].numel(),
              "input " + std::to_string(j));
    total += inputs[j].numel();
  }
  for (size_t r = 0; r < outputLists.size(); ++r) {
    RR_CHECK_VALUE(outputLists[r].size() == inputs.size(), ctx, "output list ", r, " has ",
                   outputLists[r].size(), " tensors, expected ", inputs.size());
    for (size_t j = 0; j < inputs.size(); ++j) {
      checkLike(ctx, outputLists[r][j], inputs[0].scalar_type(), inputs[j].numel(),
                "output " + std::to_string(r) + "/" + std::to_string(j));
      checkWritable(ctx, outputLists[r][j], "output " + std::to_string(r) + "/" + std::to_string(j));
    }
  }
  std::vector<at::Tensor> flatOuts;
  for (auto& l : outputLists) flatOuts.insert(flatOuts.end(), l.begin(), l.end());
  std::vector<at::Tensor> all = flatOuts;
  all.insert(all.end(), inputs.begin(), inputs.end());
  DeviceStage stage = DeviceStage::begin(ctx, all);
  OpInfo op = makeOp(OpKind::kAllgather, "allgather_coalesced", inputs[0], kNoReduceOp, total);
  std::vector<at::Tensor> ins = stage.in(inputs);
  std::vector<std::vector<at::Tensor>> outs;
  for (const auto& l : outputLists) outs.push_back(stage.out(l));
  return enqueue(std::move(op), opts.timeout, OpType::ALLGATHER_COALESCED, flatOuts, opts.asyncOp,
                 [ins, outs, total](const Comm& c) {
                   auto blocks = allgatherFlat(c, ins, total);
                   for (int r = 0; r < c.size; ++r) {
                     int64_t offset = 0;
                     for (const auto& t : outs[r]) {
                       t.copy_(blocks[r].narrow(0, offset, t.numel()).view(t.sizes()));
                       offset += t.numel();
                     }
                   }
                 },
                 std::move(stage), inputs);
} RR_REJECTED_AT_CALL

c10::intrusive_ptr<c10d::Work> Backend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) try {
  OpContext ctx = nextContext("allgather_into_tensor_coalesced", inputs);
  const int64_t total = checkCoalescedPairs(ctx, inputs, "input", outputs, "output", getSize());
  for (size_t j = 0; j < outputs.size(); ++j) {
    checkWritable(ctx, outputs[j], "output " + std::to_string(j));
  }
  std::vector<at::Tensor> all = outputs;
  all.insert(all.end(), inputs.begin(), inputs.end());
  DeviceStage stage = DeviceStage::begin(ctx, all);
  OpInfo op = makeOp(OpKind::kAllgather, "allgather_into_tensor_coalesced", inputs[0],
                     kNoReduceOp, total);
  std::vector<at::Tensor> ins = stage.in(inputs), outs = stage.out(outputs);
  return enqueue(std::move(op), opts.timeout, OpType::ALLGATHER_COALESCED, outputs, opts.asyncOp,
                 [ins, outs, total](const Comm& c) {
                   // Output j takes input j's slice of every rank's block, in
                   // rank order.
                   auto blocks = allgatherFlat(c, ins, total);
                   int64_t offset = 0;
                   for (size_t j = 0; j < outs.size(); ++j) {
                     const int64_t n = ins[j].numel();
                     std::vector<at::Tensor> pieces;
                     for (const auto& b : blocks) pieces.push_back(b.narrow(0, offset, n));
                     outs[j].copy_(at::cat(pieces).view(outs[j].sizes()));
                     offset += n;
                   }
                 },
                 std::move(stage), inputs);
} RR_REJECTED_AT_CALL

c10::intrusive_ptr<c10d::Work> Backend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs,
                                                   const c10d::GatherOptions& opts) try {
  OpContext ctx = nextContext("gather", inputs);
  const at::Tensor in = single(ctx, inputs, "input");
  checkRoot(ctx, opts.rootRank, getSize(), "root rank");
  int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outs;
  if (getRank() == root) {
    // Only the root sees these: a problem here fails the whole group (the
    // other ranks are already in the op) with the root's message.
    roleChecks(ctx, root, [&] {
      RR_CHECK_VALUE(outputs.size() == 1, ctx, "the root needs one output list, got ",
                     outputs.size());
      checkList(ctx, outputs[0], getSize(), in.scalar_type(), in.numel(), "output");
      for (const auto& t : outputs[0]) checkWritable(ctx, t, "output tensor");
    });
    outs = outputs[0];
  } else {
    roleChecks(ctx, root, [&] {
      RR_CHECK_VALUE(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()), ctx,
                     "only the root (rank ", root, ") takes output tensors");
    });
  }
  std::vector<at::Tensor> all = outs;
  all.push_back(in);
  // The root's list may mix devices where the others' tensor cannot.
  DeviceStage stage;
  roleChecks(ctx, root, [&] { stage = DeviceStage::begin(ctx, all); });
  OpInfo op = makeOp(OpKind::kGather, "gather", in, kNoReduceOp, in.numel(), root);
  std::vector<at::Tensor> hostOuts = stage.out(outs);
  at::Tensor h = stage.in(in);
  return enqueue(std::move(op), opts.timeout, OpType::GATHER, outs, opts.asyncOp,
                 [in = h, outs = hostOuts, root](const Comm& c) {
                   std::vector<size_t> bytes(c.size, nbytes(in));
                   if (c.rank != root) {
                     at::Tensor s = staged(in);
                     std::vector<char*> blocks(c.size, nullptr);
                     blocks[c.rank] = bytesOf(s);
                     gatherDirect(c, blocks, bytes, root);
                     return;
                   }
                   auto s = stagedAll(outs);
                   s[c.rank].view(-1).copy_(in.reshape(-1));
                   gatherDirect(c, blocksOf(s), bytes, root);
                   writeBackAll(outs, s);
                 },
                 std::move(stage), inputs);
} RR_REJECTED_AT_CALL

c10::intrusive_ptr<c10d::Work> Backend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions& opts) try {
  OpContext ctx = nextContext("scatter", outputs);
  const at::Tensor out = single(ctx, outputs, "output");
  checkWritable(ctx, out, "output");
  checkRoot(ctx, opts.rootRank, getSize(), "root rank");
  int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> ins;
  if (getRank() == root) {
    roleChecks(ctx, root, [&] {
      RR_CHECK_VALUE(inputs.size() == 1, ctx, "the root needs one input list, got ",
                     inputs.size());
      checkList(ctx, inputs[0], getSize(), out.scalar_type(), out.numel(), "input");
    });
    ins = inputs[0];
  } else {
    roleChecks(ctx, root, [&] {
      RR_CHECK_VALUE(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()), ctx,
                     "only the root (rank ", root, ") takes input tensors");
    });
  }
  std::vector<at::Tensor> all = ins;
  all.push_back(out);
  // The root's list may mix devices where the others' tensor cannot.
  DeviceStage stage;
  roleChecks(ctx, root, [&] { stage = DeviceStage::begin(ctx, all); });
  OpInfo op = makeOp(OpKind::kScatter, "scatter", out, kNoReduceOp, out.numel(), root);
  std::vector<at::Tensor> hostIns = stage.in(ins);
  at::Tensor h = stage.out(out);
  return enqueue(std::move(op), opts.timeout, OpType::SCATTER, outputs, opts.asyncOp,
                 [ins = hostIns, out = h, root](const Comm& c) {
                   std::vector<size_t> bytes(c.size, nbytes(out));
                   at::Tensor s = staged(out);
                   if (c.rank != root) {
                     std::vector<char*> blocks(c.size, nullptr);
                     blocks[c.rank] = bytesOf(s);
                     scatterDirect(c, blocks, bytes, root);
                   } else {
                     auto sIn = stagedAll(ins);
                     scatterDirect(c, blocksOf(sIn), bytes, root);
                     s.view(-1).copy_(sIn[root].reshape(-1));
                   }
                   writeBack(out, s);
                 },
                 std::move(stage));
} RR_REJECTED_AT_CALL

}  // namespace ringreduce
