// norm_cases.h: one calling convention over the four norm ops, so each suite is written once.
#pragma once

#include "test_util.h"

namespace fwtest {

enum class Op { layernorm, rmsnorm, headnorm, adalayernorm };
inline const char* op_name(Op op) {
  switch (op) {
    case Op::layernorm: return "layernorm";
    case Op::rmsnorm: return "rmsnorm";
    case Op::headnorm: return "headnorm";
    case Op::adalayernorm: return "adalayernorm";
  }
  return "?";
}

struct FwdRefs { TensorRef x, w, b, y, mean, rstd; double eps = 1e-5, offset = 0.0; };
struct BwdRefs { TensorRef dy, x, w, mean, rstd, dx, dw, db; double offset = 0.0; };

inline void run_fwd(Op op, const FwdRefs& a, Stream s = nullptr) {
  switch (op) {
    case Op::layernorm: layernorm_fwd({a.x, a.w, a.b, a.y, a.mean, a.rstd, a.eps, a.offset}, s); break;
    case Op::rmsnorm: rmsnorm_fwd({a.x, a.w, a.y, a.rstd, a.eps, a.offset}, s); break;
    case Op::headnorm: headnorm_fwd({a.x, a.w, a.b, a.y, a.mean, a.rstd, a.eps, a.offset}, s); break;
    case Op::adalayernorm: adalayernorm_fwd({a.x, a.w, a.b, a.y, a.mean, a.rstd, a.eps}, s); break;
  }
}
inline std::size_t bwd_ws(Op op, const BwdRefs& a) {
  switch (op) {
    case Op::layernorm: return layernorm_bwd_workspace_size({a.dy, a.x, a.w, a.mean, a.rstd, a.dx, a.dw, a.db, a.offset});
    case Op::rmsnorm: return rmsnorm_bwd_workspace_size({a.dy, a.x, a.w, a.rstd, a.dx, a.dw, a.offset});
    case Op::headnorm: return headnorm_bwd_workspace_size({a.dy, a.x, a.w, a.mean, a.rstd, a.dx, a.dw, a.db, a.offset});
    case Op::adalayernorm: return adalayernorm_bwd_workspace_size({a.dy, a.x, a.w, a.mean, a.rstd, a.dx, a.dw, a.db});
  }
  return 0;
}
inline void run_bwd(Op op, const BwdRefs& a, void* ws, std::size_t wsb, Stream s = nullptr) {
  switch (op) {
    case Op::layernorm: layernorm_bwd({a.dy, a.x, a.w, a.mean, a.rstd, a.dx, a.dw, a.db, a.offset}, ws, wsb, s); break;
    case Op::rmsnorm: rmsnorm_bwd({a.dy, a.x, a.w, a.rstd, a.dx, a.dw, a.offset}, ws, wsb, s); break;
    case Op::headnorm: headnorm_bwd({a.dy, a.x, a.w, a.mean, a.rstd, a.dx, a.dw, a.db, a.offset}, ws, wsb, s); break;
    case Op::adalayernorm: adalayernorm_bwd({a.dy, a.x, a.w, a.mean, a.rstd, a.dx, a.dw, a.db}, ws, wsb, s); break;
  }
}

// Shapes of one problem: x and the parameters, for `rows` x `n` data.
struct Problem {
  Op op;
  std::vector<std::int64_t> x_shape, p_shape;
  std::int64_t rows = 0, n = 0;
  bool has_b = true;
};
// layernorm/rmsnorm: x (rows, n); headnorm: x (rows / 4, 4, n) with 4 heads (or 1 when rows < 4);
// adaLN: x (2, rows / 2, n) (or (1, rows, n)).
inline Problem make_problem(Op op, std::int64_t rows, std::int64_t n) {
  Problem p{op, {}, {}, rows, n, op != Op::rmsnorm};
  switch (op) {
    case Op::layernorm:
    case Op::rmsnorm: p.x_shape = {rows, n}; p.p_shape = {n}; break;
    case Op::headnorm: {
      const std::int64_t nh = rows % 4 == 0 ? 4 : 1;
      p.x_shape = {rows / nh, nh, n};
      p.p_shape = {nh, n};
      break;
    }
    case Op::adalayernorm: {
      const std::int64_t b = rows % 2 == 0 ? 2 : 1;
      p.x_shape = {b, rows / b, n};
      p.p_shape = {b, 1, n};
      break;
    }
  }
  return p;
}

}  // namespace fwtest
