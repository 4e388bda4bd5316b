// Per-sample colour jitter (brightness, contrast, saturation, hue in each sample's own order) on the CPU,
// with an optional per-channel affine map (a folded Normalize) at the end; see color_jitter_cpu.py.
//
// The arithmetic is vision/lcv_vision/data/functional/color.py's (float32, 0..255 units, a clip to [0, 255] after
// every blend); the tests compare it with that module's float64 eager path.  Each sample runs only its own
// steps that change something (a factor of 1 or a hue shift of 0 is skipped), on tiles of a few thousand
// pixels: a tile's channel planes are loaded once (uint8 or float, any pixel strides), every step runs on it
// while it is in the L1 cache, and the result is stored straight into the output (float32, any strides,
// e.g. channels_last).  Contrast needs the mean grey level of the image as it enters that step: a first pass
// runs the steps before it tile by tile, sums the grey level and keeps the tiles in a per-thread scratch
// buffer (one image), and the second pass runs contrast and the steps after it from there.
//
// Only headers of the standard library and pybind11 (no ATen): the Python side checks the tensors and passes
// data pointers and strides, which keeps the first-use build to a few seconds.  The call releases the GIL;
// the loops are plain per-sample C++ loops (no OpenMP): the pipeline's worker threads are the parallelism.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kTile = 2048;  // pixels per tile: 3 float planes = 24 KiB, within L1
constexpr float kGray[3] = {0.299f, 0.587f, 0.114f};

enum Step : int64_t { kBrightness = 0, kContrast = 1, kSaturation = 2, kHue = 3 };

struct Strides {
  int64_t c, h, w;
};

inline float clip255(float v) { return std::min(std::max(v, 0.0f), 255.0f); }

// Load pixels [h, w0, w0 + n) of each channel (row segment) into planes[c] + offset.
template <typename T>
void load_row(const T* src, Strides s, int64_t channels, int64_t h, int64_t w0, int64_t n, float* const* planes,
              int64_t offset) {
  for (int64_t c = 0; c < channels; ++c) {
    const T* row = src + c * s.c + h * s.h + w0 * s.w;
    float* dst = planes[c] + offset;
    if (s.w == 1) {
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(row[i]);
    } else {
      const int64_t sw = s.w;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(row[i * sw]);
    }
  }
}

void store_row(float* dst, Strides s, int64_t channels, int64_t h, int64_t w0, int64_t n, const float* const* planes,
               int64_t offset, const float* scale, const float* bias) {
  if (channels == 3 && s.w == 3 && s.c == 1) {  // channels_last: interleaved, one store group per pixel
    float* __restrict__ row = dst + h * s.h + w0 * 3;
    const float* __restrict__ r = planes[0] + offset;
    const float* __restrict__ g = planes[1] + offset;
    const float* __restrict__ b = planes[2] + offset;
    const float a0 = scale ? scale[0] : 1.0f, a1 = scale ? scale[1] : 1.0f, a2 = scale ? scale[2] : 1.0f;
    const float b0 = scale ? bias[0] : 0.0f, b1 = scale ? bias[1] : 0.0f, b2 = scale ? bias[2] : 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      row[3 * i] = r[i] * a0 + b0;
      row[3 * i + 1] = g[i] * a1 + b1;
      row[3 * i + 2] = b[i] * a2 + b2;
    }
    return;
  }
  for (int64_t c = 0; c < channels; ++c) {
    float* row = dst + c * s.c + h * s.h + w0 * s.w;
    const float* p = planes[c] + offset;
    const float a = scale ? scale[c] : 1.0f, b = scale ? bias[c] : 0.0f;
    if (s.w == 1) {
      for (int64_t i = 0; i < n; ++i) row[i] = p[i] * a + b;
    } else {
      const int64_t sw = s.w;
      for (int64_t i = 0; i < n; ++i) row[i * sw] = p[i] * a + b;
    }
  }
}

// clip(f x + (1 - f) z) with z = 0 (brightness), the mean grey level (contrast) or the grey pixel
// (saturation); written as torch.addcmul(y, x, f) is in color.py: y + x * f.
void blend(float* const* planes, int64_t channels, int64_t n, Step step, float f, float mean) {
  const float keep = 1.0f - f;
  if (step == kSaturation) {
    if (channels != 3) return;  // saturation of a grey image is the identity
    float* __restrict__ r = planes[0];
    float* __restrict__ g = planes[1];
    float* __restrict__ b = planes[2];
    for (int64_t i = 0; i < n; ++i) {
      const float y = keep * (r[i] * kGray[0] + g[i] * kGray[1] + b[i] * kGray[2]);
      r[i] = clip255(y + r[i] * f);
      g[i] = clip255(y + g[i] * f);
      b[i] = clip255(y + b[i] * f);
    }
    return;
  }
  const float y = step == kContrast ? keep * mean : 0.0f;
  for (int64_t c = 0; c < channels; ++c) {
    float* p = planes[c];
    for (int64_t i = 0; i < n; ++i) p[i] = clip255(y + p[i] * f);
  }
}

// v mod 6 as color.py computes it, v - 6 floor(v / 6); the floor by truncation (|v| < 2^31 here, it is
// a hue in sixths of a turn) vectorizes where std::floor does not.
inline float mod6(float v) {
  const float q = v * (1.0f / 6.0f);
  float t = static_cast<float>(static_cast<int32_t>(q));
  t = t > q ? t - 1.0f : t;
  return v - 6.0f * t;
}

// color.py's hue_planes: rotate the hue by `shift` turns, keeping each pixel's max and min.
void hue(float* const* planes, int64_t n, float shift) {
  float* __restrict__ r = planes[0];
  float* __restrict__ g = planes[1];
  float* __restrict__ b = planes[2];
  const float shift6 = 6.0f * shift;
  for (int64_t i = 0; i < n; ++i) {
    const float rv = r[i], gv = g[i], bv = b[i];
    const float maxc = std::max(std::max(rv, gv), bv);
    const float delta = maxc - std::min(std::min(rv, gv), bv);
    // OpenCV's branch order (max == r, then max == g, then b) as selects, so that the loop vectorizes.
    float num = maxc == gv ? bv - rv + 2.0f * delta : rv - gv + 4.0f * delta;
    num = maxc == rv ? gv - bv : num;
    const float hue6 = mod6(num / (delta == 0.0f ? 1.0f : delta) + shift6);
    // hue6 + offset lies in [1, 11): its mod 6 is one conditional subtraction.
    float k0 = hue6 + 5.0f, k1 = hue6 + 3.0f, k2 = hue6 + 1.0f;
    k0 = k0 >= 6.0f ? k0 - 6.0f : k0;
    k1 = k1 >= 6.0f ? k1 - 6.0f : k1;
    k2 = k2 >= 6.0f ? k2 - 6.0f : k2;
    r[i] = maxc - delta * std::min(std::max(std::min(k0, 4.0f - k0), 0.0f), 1.0f);
    g[i] = maxc - delta * std::min(std::max(std::min(k1, 4.0f - k1), 0.0f), 1.0f);
    b[i] = maxc - delta * std::min(std::max(std::min(k2, 4.0f - k2), 0.0f), 1.0f);
  }
}

// Sum of the grey level over a tile, in double (8 lanes, so that the loop vectorizes).
double gray_sum(const float* const* planes, int64_t channels, int64_t n) {
  double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t full = n - n % 8;
  for (int64_t i = 0; i < full; i += 8) {
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t k = i + j;
      const float v = channels == 3 ? planes[0][k] * kGray[0] + planes[1][k] * kGray[1] + planes[2][k] * kGray[2]
                                    : planes[0][k];
      lanes[j] += static_cast<double>(v);
    }
  }
  double total = 0.0;
  for (int64_t i = full; i < n; ++i) {
    total += channels == 3 ? planes[0][i] * kGray[0] + planes[1][i] * kGray[1] + planes[2][i] * kGray[2]
                           : planes[0][i];
  }
  for (double v : lanes) total += v;
  return total;
}

struct Sample {
  int64_t steps[4];  // the sample's steps that change something, in its order
  float factors[4];
  int64_t count = 0;
  int64_t contrast_at = -1;  // index in steps, -1 without contrast
};

void run_steps(const Sample& s, int64_t from, int64_t to, float* const* planes, int64_t channels, int64_t n,
               float mean) {
  for (int64_t k = from; k < to; ++k) {
    if (s.steps[k] == kHue) {
      hue(planes, n, s.factors[k]);
    } else {
      blend(planes, channels, n, static_cast<Step>(s.steps[k]), s.factors[k], mean);
    }
  }
}

// One tile is the row segments covering `n` pixels from pixel index `start` (row-major).
template <typename Fn>
void for_segments(int64_t start, int64_t n, int64_t width, Fn&& fn) {
  int64_t offset = 0;
  while (offset < n) {
    const int64_t p = start + offset;
    const int64_t h = p / width, w0 = p % width;
    const int64_t len = std::min(width - w0, n - offset);
    fn(h, w0, len, offset);
    offset += len;
  }
}

template <typename T>
void jitter_sample(const T* src, Strides si, float* dst, Strides so, int64_t channels, int64_t height, int64_t width,
                   const Sample& s, const float* scale, const float* bias) {
  thread_local std::vector<float> tile_buf;
  thread_local std::vector<float> scratch;
  tile_buf.resize(3 * kTile);
  float* tile[3] = {tile_buf.data(), tile_buf.data() + kTile, tile_buf.data() + 2 * kTile};
  const int64_t pixels = height * width;
  float mean = 0.0f;
  int64_t first = 0;  // steps from here on run in the second (or only) pass
  const bool prefix = s.contrast_at > 0;
  if (s.contrast_at >= 0) {
    // Pass 1: the steps before contrast, the grey sum of their output, kept in `scratch` if there are any.
    if (prefix) scratch.resize(static_cast<size_t>(channels * pixels));
    double total = 0.0;
    for (int64_t start = 0; start < pixels; start += kTile) {
      const int64_t n = std::min(kTile, pixels - start);
      for_segments(start, n, width, [&](int64_t h, int64_t w0, int64_t len, int64_t off) {
        load_row(src, si, channels, h, w0, len, tile, off);
      });
      run_steps(s, 0, s.contrast_at, tile, channels, n, 0.0f);
      total += gray_sum(tile, channels, n);
      if (prefix) {
        for (int64_t c = 0; c < channels; ++c) std::copy(tile[c], tile[c] + n, scratch.data() + c * pixels + start);
      }
    }
    mean = static_cast<float>(total / static_cast<double>(pixels));
    first = s.contrast_at;
  }
  for (int64_t start = 0; start < pixels; start += kTile) {
    const int64_t n = std::min(kTile, pixels - start);
    float* kept[3] = {nullptr, nullptr, nullptr};  // this tile of pass 1's output, worked on where it is
    float* const* planes = tile;
    if (prefix) {
      for (int64_t c = 0; c < channels; ++c) kept[c] = scratch.data() + c * pixels + start;
      planes = kept;
    } else {
      for_segments(start, n, width, [&](int64_t h, int64_t w0, int64_t len, int64_t off) {
        load_row(src, si, channels, h, w0, len, tile, off);
      });
    }
    run_steps(s, first, s.count, planes, channels, n, mean);
    for_segments(start, n, width, [&](int64_t h, int64_t w0, int64_t len, int64_t off) {
      store_row(dst, so, channels, h, w0, len, planes, off, scale, bias);
    });
  }
}

// images: (N, C, H, W) uint8 or float32 at `src` with element strides `si`; out: float32 (N, C, H, W) at
// `dst` with strides `so`.  factors: float32 (N, 4) contiguous (brightness, contrast, saturation, hue);
// order: int64 (N, 4) contiguous; scale/bias: float32 (N, C) contiguous, or 0 for none.
void color_jitter(uintptr_t src, bool is_uint8, std::vector<int64_t> si, uintptr_t dst, std::vector<int64_t> so,
                  int64_t n, int64_t channels, int64_t height, int64_t width, uintptr_t factors, uintptr_t order,
                  uintptr_t scale, uintptr_t bias, bool apply_hue) {
  if (si.size() != 4 || so.size() != 4) throw std::invalid_argument("color_jitter: strides must have 4 entries");
  if (channels != 1 && channels != 3) throw std::invalid_argument("color_jitter: 1 or 3 channels");
  const auto* f = reinterpret_cast<const float*>(factors);
  const auto* o = reinterpret_cast<const int64_t*>(order);
  const auto* sc = reinterpret_cast<const float*>(scale);
  const auto* bi = reinterpret_cast<const float*>(bias);
  const Strides in_s{si[1], si[2], si[3]}, out_s{so[1], so[2], so[3]};
  for (int64_t i = 0; i < n; ++i) {
    Sample s;
    for (int64_t k = 0; k < 4; ++k) {
      const int64_t step = o[i * 4 + k];
      const float value = f[i * 4 + step];
      const bool identity = step == kHue ? (!apply_hue || channels != 3 || value == 0.0f)
                                         : (value == 1.0f || (step == kSaturation && channels != 3));
      if (identity) continue;
      if (step == kContrast) s.contrast_at = s.count;
      s.steps[s.count] = step;
      s.factors[s.count] = value;
      ++s.count;
    }
    const float* sample_scale = sc ? sc + i * channels : nullptr;
    const float* sample_bias = bi ? bi + i * channels : nullptr;
    float* out = reinterpret_cast<float*>(dst) + i * so[0];
    if (is_uint8) {
      const auto* in = reinterpret_cast<const uint8_t*>(src) + i * si[0];
      jitter_sample(in, in_s, out, out_s, channels, height, width, s, sample_scale, sample_bias);
    } else {
      const auto* in = reinterpret_cast<const float*>(src) + i * si[0];
      jitter_sample(in, in_s, out, out_s, channels, height, width, s, sample_scale, sample_bias);
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("color_jitter", &color_jitter, py::call_guard<py::gil_scoped_release>(),
        "Per-sample colour jitter (+ folded normalize) of a uint8/float32 batch into a float32 output");
}
