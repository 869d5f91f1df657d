// norm_ref.cpp: CPU reference of the LayerNorm family (MATH.md §1), the definition the CUDA kernels
// are checked against. Straight loops, double accumulation, two-pass variance, rows in order:
//   fwd:  mean = sum x / N, var = sum (x - mean)^2 / N, rstd = 1/sqrt(var + eps),
//         y = (x - mean) * rstd * s + b  with s = weight_offset + w (1 without w)   (rms: mean = 0)
//   bwd:  g = dy * s, dx = rstd * (g - mean(g) - xhat * mean(g * xhat))            (rms: no mean(g))
//         dw[group] += dy * xhat, db[group] += dy over the rows of the group, in row order.
// The saved mean/rstd are fp32 (as the kernels store them); the backward uses them as given.
#include "reference/norm_ref.h"

#include <cmath>
#include <vector>

#include "common/half.h"

namespace fastweight::detail {
namespace {

double load(const void* base, std::int64_t i, DType t) { return load_as_double(base, i, t); }

double scale_at(const RowNormParams& p, std::int64_t g, std::int64_t c) {
  return p.w ? p.weight_offset_d + load(p.w, g * p.w_group_stride + c, p.param) : 1.0;
}

}  // namespace

void rownorm_fwd_reference(const RowNormParams& p) {
  const std::int64_t n = p.n;
  for (std::int64_t g = 0; g < p.groups; ++g) {
    for (std::int64_t j = 0; j < p.rows_per_group; ++j) {
      const std::int64_t r = p.row_of(g, j);
      const std::int64_t xo = p.x_rows.offset(r), yo = p.y_rows.offset(r);
      double mean = 0.0;
      if (!p.rms) {
        for (std::int64_t c = 0; c < n; ++c) mean += load(p.x, xo + c, p.io);
        mean /= double(n);
      }
      double var = 0.0;
      for (std::int64_t c = 0; c < n; ++c) {
        const double d = load(p.x, xo + c, p.io) - mean;
        var += d * d;
      }
      var /= double(n);
      const double rstd = 1.0 / std::sqrt(var + p.eps_d);
      for (std::int64_t c = 0; c < n; ++c) {
        double v = (load(p.x, xo + c, p.io) - mean) * rstd * scale_at(p, g, c);
        if (p.b) v += load(p.b, g * p.b_group_stride + c, p.param);
        store_from_double(p.y, yo + c, p.io, v);
      }
      if (p.mean) p.mean[r] = float(mean);
      if (p.rstd) p.rstd[r] = float(rstd);
    }
  }
}

void rownorm_bwd_reference(const RowNormParams& p) {
  const std::int64_t n = p.n;
  std::vector<double> dw(p.dw ? n : 0), db(p.db ? n : 0), xhat(n), gv(n);
  for (std::int64_t g = 0; g < p.groups; ++g) {
    std::fill(dw.begin(), dw.end(), 0.0);
    std::fill(db.begin(), db.end(), 0.0);
    for (std::int64_t j = 0; j < p.rows_per_group; ++j) {
      const std::int64_t r = p.row_of(g, j);
      const std::int64_t xo = p.x_rows.offset(r), dyo = p.dy_rows.offset(r), dxo = p.dx_rows.offset(r);
      const double mean = p.rms ? 0.0 : double(p.mean[r]);
      const double rstd = double(p.rstd[r]);
      double sum_g = 0.0, sum_gx = 0.0;
      for (std::int64_t c = 0; c < n; ++c) {
        const double dy = load(p.dy, dyo + c, p.io);
        xhat[c] = (load(p.x, xo + c, p.io) - mean) * rstd;
        gv[c] = dy * scale_at(p, g, c);
        sum_g += gv[c];
        sum_gx += gv[c] * xhat[c];
        if (p.dw) dw[c] += dy * xhat[c];
        if (p.db) db[c] += dy;
      }
      const double mg = p.rms ? 0.0 : sum_g / double(n), mgx = sum_gx / double(n);
      for (std::int64_t c = 0; c < n; ++c)
        store_from_double(p.dx, dxo + c, p.io, rstd * (gv[c] - mg - xhat[c] * mgx));
    }
    for (std::int64_t c = 0; c < n; ++c) {
      if (p.dw) store_from_double(p.dw, g * p.dw_group_stride + c, p.param, dw[c]);
      if (p.db) store_from_double(p.db, g * p.db_group_stride + c, p.param, db[c]);
    }
  }
}

}  // namespace fastweight::detail
