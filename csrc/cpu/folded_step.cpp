// The memorization trainer's training gradients in one call (CPU, float32): the folded model's
// forward (mhakern/memorize/model.py, folded_forward with attn "fused", layout "rows", a context
// per example or one per run, d_v = 1), the per-example cross-entropy, the weighted mean per run and the
// gradients of its sum with respect to the eight weights -- the operations autograd runs for
// StepEngine._step (mhakern/memorize/train.py), each one the same ATen call or the same
// mhakern_C operator on the same operands, so the same bits, without the interpreter and the
// autograd engine between them (about 1 ms of a 7 ms step at the paper's shape on one thread:
// docs/results.md, section 4).
//
// `plan` says which kernel each product runs, as mhakern/memorize/fused_step.py decided it
// (the products' bit checks of products.py), by the field names of folded_step_fields: a
// blocking kc >= 0 runs dense_bmm, -1 the ATen product. The caller checks the
// whole call against autograd once per shape and process before using it.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace mhakern::cpu {
namespace {

// The plan's fields, in order; their names (folded_step_fields) are what
// mhakern/memorize/fused_step.py fills them by.
enum Plan : int64_t {
  kEmbedQuery,   // t0 = x_0 W_E + (b_E + pe_0)
  kEmbedCtx,     // C = x W_E + (b_E + pe_1..n)
  kQueries,      // u = t0 A
  kHeadsOut,     // o = p W_O
  kDecode,       // logits = o W_D + b_D (dense_bmm with the bias; -1: baddbmm)
  kGradDecodeA,  // d o   = g W_D^T
  kGradDecodeB,  // d W_D = o^T g
  kGradHeadsA,   // d p   = d o W_O^T
  kGradHeadsB,   // d W_O = p^T d o
  kGradQueriesA, // d t0  = d u A^T
  kGradQueriesB, // d A   = t0^T d u
  kGradEmbedCtx, // d W_E from the context: x^T d C
  kGradEmbedQuery,  // d W_E from the query: x_0^T d t0
  kPlanFields
};

const char* const kFieldNames[kPlanFields] = {
    "embed_query",    "embed_ctx",      "queries",        "heads_out",      "decode",
    "grad_decode_a",  "grad_decode_b",  "grad_heads_a",   "grad_heads_b",   "grad_queries_a",
    "grad_queries_b", "grad_embed_ctx", "grad_embed_query"};

std::vector<std::string> folded_step_fields() { return {kFieldNames, kFieldNames + kPlanFields}; }

using DenseBmm = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t);

at::Tensor dense_bmm(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, int64_t kc) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mhakern_C::dense_bmm", "").typed<DenseBmm>();
  return op.call(a, b, bias, kc);
}

// products.mm: dense_bmm where the plan found a blocking, else torch.bmm.
at::Tensor mm(const at::Tensor& a, const at::Tensor& b, int64_t kc) {
  return kc >= 0 ? dense_bmm(a, b, std::nullopt, kc) : at::bmm(a, b);
}

// products.embed's forward on tokens x (R, ..., L, d_in) at positions pe (L, d): the bias
// b_E + pe as the composite adds it, the product with that bias added as each tile is made.
at::Tensor embed(const at::Tensor& x, const at::Tensor& W_E, const at::Tensor& b_E, const at::Tensor& pe, int64_t kc) {
  const int64_t R = x.size(0), d = W_E.size(2);
  std::vector<int64_t> bview(x.dim(), 1);
  bview[0] = R;
  bview.back() = d;
  const at::Tensor bias = at::add(b_E.view(bview), pe);
  return dense_bmm(x.reshape({R, -1, x.size(-1)}), W_E, bias.reshape({R, -1, d}), kc);
}

// params: W_E (R, d_in, d), b_E (R, d), W_Q (R, d, H, d_h), W_K (R, H, d, d_h), W_V (R, H, d, 1),
// W_O (R, H, d), W_D (R, d, C), b_D (R, C) (model.PARAM_NAMES' order); query (R, b, d_in), ctx
// (R, b, n, d_in) a context per example or (R, n, d_in) one per run, y (R, b) class indices, w
// (R, b) example weights, pe (n + 1, d) positions.
// Returns the eight gradients, in params' order.
std::vector<at::Tensor> folded_step_grads(at::TensorList params, const at::Tensor& query, const at::Tensor& ctx,
                                          const at::Tensor& y, const at::Tensor& w, const at::Tensor& pe,
                                          double scale, at::IntArrayRef plan) {
  TORCH_CHECK_VALUE(params.size() == 8, "folded_step_grads: params must be the 8 weights, got ", params.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(plan.size()) == kPlanFields, "folded_step_grads: plan must have ",
                    static_cast<int64_t>(kPlanFields), " fields, got ", plan.size());
  TORCH_CHECK_VALUE(plan[kEmbedQuery] >= 0 && plan[kEmbedCtx] >= 0, "folded_step_grads: plan: the embeddings ",
                    "run on dense_bmm only (embed_query, embed_ctx >= 0), got ", plan[kEmbedQuery], ", ",
                    plan[kEmbedCtx]);
  const at::Tensor &W_E = params[0], &b_E = params[1], &W_Q = params[2], &W_K = params[3], &W_V = params[4],
                   &W_O = params[5], &W_D = params[6], &b_D = params[7];
  for (size_t i = 0; i < params.size(); ++i)
    TORCH_CHECK_VALUE(params[i].device().is_cpu() && params[i].scalar_type() == at::kFloat,
                      "folded_step_grads: params[", i, "] must be a float32 CPU tensor");
  TORCH_CHECK_VALUE(query.dim() == 3 && (ctx.dim() == 4 || ctx.dim() == 3) && W_V.dim() == 4 && W_V.size(3) == 1 &&
                        W_K.dim() == 4,
                    "folded_step_grads: query (R, b, d_in), ctx (R, b, n, d_in) or (R, n, d_in) and W_V (R, H, d, 1) "
                    "expected, got ",
                    query.sizes(), ", ", ctx.sizes(), ", ", W_V.sizes());
  TORCH_CHECK_VALUE(W_E.dim() == 3 && W_D.dim() == 3 && pe.dim() == 2, "folded_step_grads: W_E (R, d_in, d), ",
                    "W_D (R, d, C) and pe (n + 1, d) expected, got ", W_E.sizes(), ", ", W_D.sizes(), ", ", pe.sizes());
  // shared: one context per run, which every query of the run reads (model._attend's C.dim() == 3)
  const bool shared = ctx.dim() == 3;
  const int64_t R = query.size(0), b = query.size(1), n = ctx.size(-2), d = W_E.size(2), H = W_K.size(1);
  const int64_t C = W_D.size(2);
  TORCH_CHECK_VALUE(b > 0 && n > 0, "folded_step_grads: query and ctx must hold examples and tokens, got ",
                    query.sizes(), " and ", ctx.sizes());
  TORCH_CHECK_VALUE(ctx.size(0) == R && (shared || ctx.size(1) == b) && ctx.size(-1) == query.size(2) &&
                        W_E.size(0) == R && W_E.size(1) == query.size(2),
                    "folded_step_grads: ctx must be (R, b, n, d_in) or (R, n, d_in) and W_E (R, d_in, d) for query "
                    "(R, b, d_in) = ",
                    query.sizes(), ", got ", ctx.sizes(), " and ", W_E.sizes());
  const int64_t dh = W_K.size(3);
  auto want = [&](const at::Tensor& t, at::IntArrayRef shape, const char* name, const char* dims) {
    TORCH_CHECK_VALUE(t.sizes() == shape, "folded_step_grads: ", name, " must be ", dims, " = ", shape, ", got ",
                      t.sizes());
  };
  want(b_E, {R, d}, "b_E", "(R, d)");
  want(W_Q, {R, d, H, dh}, "W_Q", "(R, d, H, d_h)");
  want(W_K, {R, H, d, dh}, "W_K", "(R, H, d, d_h)");
  want(W_V, {R, H, d, 1}, "W_V", "(R, H, d, 1)");
  want(W_O, {R, H, d}, "W_O", "(R, H, d)");
  want(W_D, {R, d, C}, "W_D", "(R, d, C)");
  want(b_D, {R, C}, "b_D", "(R, C)");
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{query, "query"}, {ctx, "ctx"}, {pe, "pe"}})
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat, "folded_step_grads: ", name,
                      " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK_VALUE(y.device().is_cpu() && y.scalar_type() == at::kLong && w.device().is_cpu(),
                    "folded_step_grads: y must be an int64 CPU tensor and w a CPU tensor, got ", y.scalar_type(),
                    " on ", y.device(), " and ", w.device());
  TORCH_CHECK_VALUE(pe.size(0) == n + 1 && pe.size(1) == d, "folded_step_grads: pe must be (n + 1, d) = (", n + 1,
                    ", ", d, "), got ", pe.sizes());
  TORCH_CHECK_VALUE(y.sizes() == query.sizes().slice(0, 2) && w.sizes() == query.sizes().slice(0, 2),
                    "folded_step_grads: y and w must be (R, b) = ", query.sizes().slice(0, 2), ", got ", y.sizes(),
                    " and ", w.sizes());
  TORCH_CHECK_VALUE(w.scalar_type() == at::kFloat, "folded_step_grads: w must be float32, got ", w.scalar_type());
  at::NoGradGuard no_grad;

  // ---- forward (model.folded_forward)
  const at::Tensor xq = query.unsqueeze(-2);  // (R, b, 1, d_in)
  const at::Tensor t0 = embed(xq, W_E, b_E, pe.slice(0, 0, 1), plan[kEmbedQuery]).view({R, b, 1, d}).squeeze(-2);
  const at::Tensor Cm = embed(ctx, W_E, b_E, pe.slice(0, 1), plan[kEmbedCtx]).view(
      shared ? at::IntArrayRef{R, n, d} : at::IntArrayRef{R, b, n, d});
  static auto fold_op = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("mhakern_C::fold_heads", "")
                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  const at::Tensor A = fold_op.call(W_Q, W_K);  // (R, d, H d)
  const at::Tensor u = mm(t0, A, plan[kQueries]).view({R, b, H, d});
  // Per example: the heads as the query rows of one head over the example's context; shared:
  // the run's b H folded queries over its one context.
  const std::vector<int64_t> qshape = shared ? std::vector<int64_t>{R, 1, b * H, d}
                                             : std::vector<int64_t>{R * b, 1, H, d};
  const at::Tensor q4 = u.reshape(qshape);
  const at::Tensor kv = shared ? Cm.unsqueeze(1) : Cm.reshape({R * b, 1, n, d});
  static auto fwd_op = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mhakern_C::fwd_plain", "")
                           .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                     const at::Tensor&, double, bool,
                                                                     const std::optional<at::Tensor>&)>();
  at::Tensor out, lse;
  std::tie(out, lse) = fwd_op.call(q4, kv, kv.view(kv.sizes()), scale, false, std::nullopt);
  out = out.contiguous();  // ops.forward_impl's same_layout for a contiguous q
  lse = lse.contiguous();
  const at::Tensor z = out.reshape({R, b, H, d});
  const at::Tensor W_Vv = W_V.view({R, 1, H, d});
  const at::Tensor p = at::mul(z, W_Vv).sum(-1);  // (R, b, H)
  const at::Tensor o = mm(p, W_O, plan[kHeadsOut]);
  const at::Tensor bD = b_D.unsqueeze(1);
  const at::Tensor logits = plan[kDecode] >= 0 ? dense_bmm(o, W_D, bD, plan[kDecode]) : at::baddbmm(bD, o, W_D);

  // ---- the loss (train._per_run_loss, then (per * w).sum(1) / w.sum(1), summed over runs)
  const at::Tensor x2 = logits.reshape({R * b, C});
  const at::Tensor target = y.reshape({R * b});
  const at::Tensor ls = at::_log_softmax(x2, 1, false);
  const at::Tensor total_weight = std::get<1>(at::nll_loss_forward(ls, target, {}, at::Reduction::None, -100));
  const at::Tensor wsum = w.sum(1);

  // ---- backward, node by node as autograd runs it
  const at::Tensor one = at::ones({}, x2.options());
  const at::Tensor dnum = at::div(one.expand({R}), wsum);                       // SumBackward0, DivBackward0
  const at::Tensor dper = at::mul(dnum.unsqueeze(1).expand({R, b}), w);         // SumBackward1, MulBackward0
  const at::Tensor dnll = at::nll_loss_backward(dper.reshape({R * b}), ls, target, {}, at::Reduction::None, -100,
                                                total_weight);
  const at::Tensor g = at::_log_softmax_backward_data(dnll, ls, 1, at::kFloat).reshape({R, b, C});
  // decode (products._Baddbmm or BaddbmmBackward0; the bias's UnsqueezeBackward0)
  const at::Tensor dbD = g.sum_to_size({R, 1, C}).squeeze(1);
  const at::Tensor d_o = mm(g, W_D.transpose(1, 2), plan[kGradDecodeA]);
  const at::Tensor dWD = mm(o.transpose(1, 2), g, plan[kGradDecodeB]);
  const at::Tensor dp = mm(d_o, W_O.transpose(1, 2), plan[kGradHeadsA]);
  const at::Tensor dWO = mm(p.transpose(1, 2), d_o, plan[kGradHeadsB]);
  // p = (z * W_V).sum(-1): SumBackward1's expand, MulBackward0, the engine's sum_to for W_V
  const at::Tensor ge = dp.unsqueeze(-1).expand({R, b, H, d});
  const at::Tensor dz = at::mul(ge, W_Vv);
  const at::Tensor dWV = at::sum_to(at::mul(ge, z), at::IntArrayRef{R, 1, H, d}).reshape(W_V.sizes());
  // attention (ops.backward_impl with kv_sum: dK + dV through k)
  static auto bwd_op = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mhakern_C::bwd_plain_kv_sum", "")
                           .typed<std::tuple<at::Tensor, at::Tensor>(
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, double, bool, const std::optional<at::Tensor>&)>();
  at::Tensor dq, dkv;
  std::tie(dq, dkv) = bwd_op.call(dz.reshape(qshape).contiguous(), q4, kv, out, lse, scale, false,
                                  std::nullopt);
  const at::Tensor du = dq.contiguous().reshape({R, b, H, d}).reshape({R, b, H * d});
  // u = t0 A (products._Bmm), A = fold(W_Q, W_K) (products._Fold)
  const at::Tensor dt0 = mm(du, A.transpose(1, 2), plan[kGradQueriesA]);
  const at::Tensor dA = mm(t0.transpose(1, 2), du, plan[kGradQueriesB]);
  static auto fold_bwd_op = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("mhakern_C::fold_heads_backward", "")
                                .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                          const at::Tensor&)>();
  at::Tensor dWQ, dWK;
  std::tie(dWQ, dWK) = fold_bwd_op.call(dA, W_Q, W_K);
  // the context's embedding (products._Embed.backward)
  const at::Tensor gC = shared ? dkv.contiguous().squeeze(1) : dkv.contiguous().reshape({R, b, n, d});
  const at::Tensor dWE_c = mm(ctx.reshape({R, -1, ctx.size(-1)}).transpose(1, 2), gC.reshape({R, -1, d}),
                              plan[kGradEmbedCtx]);
  // _Embed.backward: to the bias's shape (b_E as (R, 1.., d) + pe), then to b_E's. One context
  // per run is already of the bias's shape (R, n, d), where sum_to_size returns the tensor itself.
  const at::Tensor dbE_c = shared ? gC.sum_to_size({R, 1, d}).reshape(b_E.sizes())
                                  : gC.sum_to_size({R, 1, n, d}).sum_to_size({R, 1, 1, d}).reshape(b_E.sizes());
  // the query's (SqueezeBackward1, then products._Embed.backward)
  const at::Tensor g0 = dt0.unsqueeze(-2);  // (R, b, 1, d)
  const at::Tensor dWE_0 = mm(xq.reshape({R, -1, xq.size(-1)}).transpose(1, 2), g0.reshape({R, -1, d}),
                              plan[kGradEmbedQuery]);
  const at::Tensor dbE_0 = g0.sum_to_size({R, 1, 1, d}).reshape(b_E.sizes());  // the bias's shape is b_E's
  // W_E and b_E each get two gradients, which autograd adds (one rounded sum: either order)
  return {at::add(dWE_c, dWE_0), at::add(dbE_c, dbE_0), dWQ, dWK, dWV, dWO, dWD, dbD};
}

}  // namespace
}  // namespace mhakern::cpu

TORCH_LIBRARY_FRAGMENT(mhakern_C, m) {
  m.def("folded_step_fields() -> str[]", &mhakern::cpu::folded_step_fields);
  m.def("folded_step_grads(Tensor[] params, Tensor query, Tensor ctx, Tensor y, Tensor w, Tensor pe, float scale, "
        "int[] plan) -> Tensor[]",
        &mhakern::cpu::folded_step_grads);
}
