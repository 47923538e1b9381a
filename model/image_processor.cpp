#include "model/image_processor.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "model/safetensors.h"
#include "model/shape_text.h"
#include "model/video_mp4.h"

namespace skyreels::model {

namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

void check_u8_image(const at::Tensor& image, const std::string& what) {
  require(image.defined() && image.dim() == 3 && image.scalar_type() == at::kByte && image.size(2) >= 1 &&
              image.size(2) <= 4,
          what + ": expected uint8 [H, W, C] pixels with C = 1, 2, 3 or 4" +
              (image.defined()
                   ? ", got " + std::string(c10::toString(image.scalar_type())) + " " + shape_text(image.sizes())
                   : std::string()));
  require(image.size(0) >= 1 && image.size(1) >= 1, what + ": the image is empty");
}

// ---- Pillow's resampling (libImaging/Resample.c) ----------------------------------------------------------------

double box_filter(double x) { return x > -0.5 && x <= 0.5 ? 1.0 : 0.0; }

double bilinear_filter(double x) {
  x = std::abs(x);
  return x < 1.0 ? 1.0 - x : 0.0;
}

double hamming_filter(double x) {
  x = std::abs(x);
  if (x == 0.0) return 1.0;
  if (x >= 1.0) return 0.0;
  x = x * M_PI;
  return std::sin(x) / x * (0.54f + 0.46f * std::cos(x));  // float constants, as Pillow writes them
}

double bicubic_filter(double x) {
  constexpr double a = -0.5;  // Pillow's (and Keys') a
  x = std::abs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

double sinc(double x) {
  if (x == 0.0) return 1.0;
  x = x * M_PI;
  return std::sin(x) / x;
}

double lanczos_filter(double x) { return -3.0 <= x && x < 3.0 ? sinc(x) * sinc(x / 3) : 0.0; }

struct Filter {
  double (*f)(double);
  double support;
};

Filter filter_of(PillowFilter filter) {
  switch (filter) {
    case PillowFilter::kBox:
      return {box_filter, 0.5};
    case PillowFilter::kBilinear:
      return {bilinear_filter, 1.0};
    case PillowFilter::kHamming:
      return {hamming_filter, 1.0};
    case PillowFilter::kBicubic:
      return {bicubic_filter, 2.0};
    case PillowFilter::kLanczos:
      return {lanczos_filter, 3.0};
    case PillowFilter::kNearest:
      break;
  }
  throw std::invalid_argument("resample: NEAREST is not a convolution filter (not supported)");
}

// 8-bit results with 2 bits of headroom for the filters' negative lobes and overshoot.
constexpr int kPrecisionBits = 32 - 8 - 2;

// One output position's source window and fixed-point weights.
struct Taps {
  int64_t first = 0;
  std::vector<int32_t> weights;
};

// precompute_coeffs + normalize_coeffs_8bpc for one axis of in_size -> out_size (the whole input as the box).
std::vector<Taps> axis_taps(int64_t in_size, int64_t out_size, const Filter& filter) {
  const double scale = static_cast<double>(static_cast<float>(in_size) - 0.0f) / static_cast<double>(out_size);
  const double filterscale = std::max(scale, 1.0);
  const double support = filter.support * filterscale;
  std::vector<Taps> taps(static_cast<size_t>(out_size));
  for (int64_t xx = 0; xx < out_size; ++xx) {
    const double center = 0.0 + (static_cast<double>(xx) + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    const int64_t xmin = std::max<int64_t>(static_cast<int>(center - support + 0.5), 0);
    const int64_t xmax = std::min<int64_t>(static_cast<int>(center + support + 0.5), in_size) - xmin;
    std::vector<double> k(static_cast<size_t>(std::max<int64_t>(xmax, 0)));
    double ww = 0.0;
    for (int64_t x = 0; x < xmax; ++x) {
      const double w = filter.f((static_cast<double>(x + xmin) - center + 0.5) * ss);
      k[static_cast<size_t>(x)] = w;
      ww += w;
    }
    Taps& t = taps[static_cast<size_t>(xx)];
    t.first = xmin;
    for (double w : k) {
      if (ww != 0.0) w /= ww;
      const double fixed = w * (1 << kPrecisionBits);
      t.weights.push_back(static_cast<int32_t>(w < 0 ? -0.5 + fixed : 0.5 + fixed));
    }
  }
  return taps;
}

// Pillow's clip8: the rounded sum's integer part, clamped to [0, 255] (the shift floors, as C's >> on negatives).
uint8_t clip8(int32_t sum) {
  const int32_t v = sum >> kPrecisionBits;
  return static_cast<uint8_t>(std::clamp(v, 0, 255));
}

// One pass along `axis` (1: width, 0: height) of a contiguous uint8 [H, W, C] image.
at::Tensor resample_axis(const at::Tensor& in, int64_t axis, int64_t out_size, const Filter& filter) {
  const int64_t h = in.size(0), w = in.size(1), c = in.size(2);
  const std::vector<Taps> taps = axis_taps(in.size(axis), out_size, filter);
  const int64_t oh = axis == 0 ? out_size : h, ow = axis == 1 ? out_size : w;
  at::Tensor out = at::empty({oh, ow, c}, at::kByte);
  const uint8_t* src = in.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  // Step between neighbouring source pixels along the axis.
  const int64_t step = axis == 1 ? c : w * c;
  for (int64_t y = 0; y < oh; ++y) {
    for (int64_t x = 0; x < ow; ++x) {
      const Taps& t = taps[static_cast<size_t>(axis == 1 ? x : y)];
      const uint8_t* base = axis == 1 ? src + (y * w + t.first) * c : src + (t.first * w + x) * c;
      for (int64_t ch = 0; ch < c; ++ch) {
        int32_t sum = 1 << (kPrecisionBits - 1);
        for (size_t i = 0; i < t.weights.size(); ++i) {
          sum += static_cast<int32_t>(base[static_cast<int64_t>(i) * step + ch]) * t.weights[i];
        }
        dst[(y * ow + x) * c + ch] = clip8(sum);
      }
    }
  }
  return out;
}

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0)) ? 1 : 0); }

}  // namespace

const char* pillow_filter_name(PillowFilter filter) {
  switch (filter) {
    case PillowFilter::kNearest:
      return "NEAREST";
    case PillowFilter::kLanczos:
      return "LANCZOS";
    case PillowFilter::kBilinear:
      return "BILINEAR";
    case PillowFilter::kBicubic:
      return "BICUBIC";
    case PillowFilter::kBox:
      return "BOX";
    case PillowFilter::kHamming:
      return "HAMMING";
  }
  return "?";
}

PillowFilter pillow_filter_from_int(int64_t resample) {
  require(resample >= 1 && resample <= 5,
          "resample: " + std::to_string(resample) +
              " is not a supported Pillow filter (1 LANCZOS, 2 BILINEAR, 3 BICUBIC, 4 BOX, 5 HAMMING; 0 NEAREST is "
              "not supported)");
  return static_cast<PillowFilter>(resample);
}

at::Tensor pillow_resize(const at::Tensor& image, int64_t height, int64_t width, PillowFilter filter) {
  check_u8_image(image, "pillow_resize");
  require(height >= 1 && width >= 1, "pillow_resize: the target size must be at least 1x1");
  const Filter f = filter_of(filter);
  at::Tensor x = image.contiguous();
  if (x.size(0) == height && x.size(1) == width) return x.clone();  // Pillow: a copy
  // Horizontal first, each pass rounded to uint8 (Pillow resamples the rows the vertical pass needs only; the
  // others never reach the output).
  if (x.size(1) != width) x = resample_axis(x, 1, width, f);
  if (x.size(0) != height) x = resample_axis(x, 0, height, f);
  return x;
}

at::Tensor convert_to_rgb(const at::Tensor& image) {
  check_u8_image(image, "convert_to_rgb");
  const int64_t c = image.size(2);
  if (c == 3) return image;
  if (c == 4) return image.narrow(2, 0, 3).contiguous();
  return image.narrow(2, 0, 1).expand({image.size(0), image.size(1), 3}).contiguous();
}

at::Tensor center_crop(const at::Tensor& image, int64_t height, int64_t width) {
  require(image.dim() == 3 && height >= 1 && width >= 1, "center_crop: expected [H, W, C] and a positive size");
  const int64_t h = image.size(0), w = image.size(1);
  int64_t top = floor_div(h - height, 2), left = floor_div(w - width, 2);
  if (top >= 0 && left >= 0 && top + height <= h && left + width <= w) {
    return image.narrow(0, top, height).narrow(1, left, width).contiguous();
  }
  // Too small: zero-padded to at least the crop, centred (ceil of half the padding on top / left), then cropped.
  const int64_t nh = std::max(height, h), nw = std::max(width, w);
  const int64_t top_pad = (nh - h + 1) / 2, left_pad = (nw - w + 1) / 2;
  at::Tensor padded = at::zeros({nh, nw, image.size(2)}, image.options());
  padded.narrow(0, top_pad, h).narrow(1, left_pad, w).copy_(image);
  top += top_pad;
  left += left_pad;
  const int64_t y0 = std::max<int64_t>(0, top), y1 = std::min(nh, top + height);
  const int64_t x0 = std::max<int64_t>(0, left), x1 = std::min(nw, left + width);
  return padded.narrow(0, y0, y1 - y0).narrow(1, x0, x1 - x0).contiguous();
}

// ---- CLIPImageProcessor --------------------------------------------------------------------------------------------

namespace {

using Json = nlohmann::json;

struct FieldReader {
  const Json& j;
  std::string where;

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw std::invalid_argument("image processor config '" + where + "': field '" + field + "' " + what);
  }
  bool has(const char* field) const { return j.contains(field) && !j[field].is_null(); }
  bool boolean(const char* field, bool fallback) const {
    if (!has(field)) return fallback;
    if (!j[field].is_boolean()) fail(field, "must be true or false, got " + j[field].dump());
    return j[field].get<bool>();
  }
  double number(const char* field, double fallback) const {
    if (!has(field)) return fallback;
    if (!j[field].is_number()) fail(field, "must be a number, got " + j[field].dump());
    return j[field].get<double>();
  }
  int64_t positive(const Json& v, const std::string& field) const {
    if (!v.is_number_integer() || v.get<int64_t>() < 1) fail(field, "must be an integer >= 1, got " + v.dump());
    return v.get<int64_t>();
  }
  std::array<double, 3> triple(const char* field, std::array<double, 3> fallback) const {
    if (!has(field)) return fallback;
    const Json& v = j[field];
    if (!v.is_array() || v.size() != 3 || !v[0].is_number() || !v[1].is_number() || !v[2].is_number()) {
      fail(field, "must be a list of 3 numbers (one per RGB channel), got " + v.dump());
    }
    return {v[0].get<double>(), v[1].get<double>(), v[2].get<double>()};
  }
};

}  // namespace

ClipImageProcessorConfig ClipImageProcessorConfig::from_json(const std::string& text, const std::string& where) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const std::exception& e) {
    throw std::invalid_argument("image processor config '" + where + "' is not valid JSON (" + e.what() + ")");
  }
  require(j.is_object(), "image processor config '" + where + "' is not a JSON object");
  const FieldReader r{j, where};
  const std::string type = j.value("image_processor_type", std::string("CLIPImageProcessor"));
  if (type != "CLIPImageProcessor" && type != "CLIPImageProcessorFast" && type != "CLIPFeatureExtractor") {
    r.fail("image_processor_type", "is '" + type + "', not a CLIPImageProcessor");
  }
  ClipImageProcessorConfig c;
  c.do_convert_rgb = r.boolean("do_convert_rgb", c.do_convert_rgb);
  c.do_resize = r.boolean("do_resize", c.do_resize);
  if (r.has("size")) {
    const Json& s = j["size"];
    if (s.is_number()) {  // an old config's int: the shortest edge (get_size_dict with default_to_square=False)
      c.shortest_edge = r.positive(s, "size");
    } else if (s.is_object() && s.contains("shortest_edge")) {
      c.shortest_edge = r.positive(s["shortest_edge"], "size.shortest_edge");
    } else if (s.is_object() && s.contains("height") && s.contains("width")) {
      c.shortest_edge = 0;
      c.size_height = r.positive(s["height"], "size.height");
      c.size_width = r.positive(s["width"], "size.width");
    } else {
      r.fail("size", "must be {\"shortest_edge\": n} or {\"height\": h, \"width\": w}, got " + s.dump());
    }
  }
  if (r.has("resample")) {
    if (!j["resample"].is_number_integer()) r.fail("resample", "must be a Pillow filter number");
    try {
      c.resample = pillow_filter_from_int(j["resample"].get<int64_t>());
    } catch (const std::invalid_argument& e) {
      r.fail("resample", std::string("is unusable: ") + e.what());
    }
  }
  c.do_center_crop = r.boolean("do_center_crop", c.do_center_crop);
  if (r.has("crop_size")) {
    const Json& s = j["crop_size"];
    if (s.is_number()) {
      c.crop_height = c.crop_width = r.positive(s, "crop_size");
    } else if (s.is_object() && s.contains("height") && s.contains("width")) {
      c.crop_height = r.positive(s["height"], "crop_size.height");
      c.crop_width = r.positive(s["width"], "crop_size.width");
    } else {
      r.fail("crop_size", "must be an integer or {\"height\": h, \"width\": w}, got " + s.dump());
    }
  }
  c.do_rescale = r.boolean("do_rescale", c.do_rescale);
  c.rescale_factor = r.number("rescale_factor", c.rescale_factor);
  c.do_normalize = r.boolean("do_normalize", c.do_normalize);
  c.image_mean = r.triple("image_mean", c.image_mean);
  c.image_std = r.triple("image_std", c.image_std);
  for (double s : c.image_std) {
    if (!(s > 0) || !std::isfinite(s)) r.fail("image_std", "must hold finite values > 0");
  }
  return c;
}

ClipImageProcessorConfig ClipImageProcessorConfig::from_file(const std::string& path) {
  std::ifstream in(path);
  require(static_cast<bool>(in), "cannot read image processor config '" + path + "'");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return from_json(text, path);
}

std::string find_image_processor_dir(const std::string& encoder_path) {
  namespace fs = std::filesystem;
  const fs::path encoder(encoder_path);
  const fs::path folder = fs::is_directory(encoder) ? encoder : encoder.parent_path();
  for (const fs::path& candidate : {folder / "image_processor", folder.parent_path() / "image_processor", folder}) {
    if (fs::exists(candidate / "preprocessor_config.json")) return candidate.string();
  }
  return "";
}

std::array<int64_t, 2> clip_resize_size(const ClipImageProcessorConfig& config, int64_t height, int64_t width) {
  if (config.shortest_edge == 0) return {config.size_height, config.size_width};
  // get_resize_output_image_size(default_to_square=False): the short side becomes the size, the long one
  // int(size * long / short) (true division, then truncation).
  const int64_t short_side = std::min(height, width), long_side = std::max(height, width);
  const auto new_long =
      static_cast<int64_t>(static_cast<double>(config.shortest_edge * long_side) / static_cast<double>(short_side));
  return width <= height ? std::array<int64_t, 2>{new_long, config.shortest_edge}
                         : std::array<int64_t, 2>{config.shortest_edge, new_long};
}

ClipPreprocessed clip_preprocess(const ClipImageProcessorConfig& config, const std::vector<at::Tensor>& images) {
  require(!images.empty(), "clip_preprocess: no images");
  ClipPreprocessed out;
  std::vector<at::Tensor> planar;
  for (size_t i = 0; i < images.size(); ++i) {
    const std::string what = "image " + std::to_string(i);
    check_u8_image(images[i], what);
    at::Tensor x = config.do_convert_rgb ? convert_to_rgb(images[i]) : images[i];
    require(x.size(2) == 3, what + ": " + std::to_string(x.size(2)) + " channels and do_convert_rgb is false");
    if (config.do_resize) {
      const auto [h, w] = clip_resize_size(config, x.size(0), x.size(1));
      require(h >= 1 && w >= 1,
              what + ": " + std::to_string(x.size(1)) + "x" + std::to_string(x.size(0)) + " resizes to nothing");
      x = pillow_resize(x, h, w, config.resample);
    }
    if (config.do_center_crop) x = center_crop(x, config.crop_height, config.crop_width);
    out.cropped.push_back(x);
    // rescale: u8 as float64 times the factor, then float32; normalize: float32 (x - mean) / std.
    at::Tensor v = config.do_rescale ? (x.to(at::kDouble) * config.rescale_factor).to(at::kFloat) : x.to(at::kFloat);
    if (config.do_normalize) {
      const auto f32 = at::TensorOptions().dtype(at::kFloat);
      const at::Tensor mean = at::tensor(std::vector<double>(config.image_mean.begin(), config.image_mean.end()), f32);
      const at::Tensor std = at::tensor(std::vector<double>(config.image_std.begin(), config.image_std.end()), f32);
      v = (v - mean) / std;
    }
    planar.push_back(v.permute({2, 0, 1}).contiguous());
  }
  for (size_t i = 1; i < planar.size(); ++i) {
    require(planar[i].sizes() == planar[0].sizes(),
            "image " + std::to_string(i) + ": preprocessed to " + shape_text(planar[i].sizes()) + ", image 0 to " +
                shape_text(planar[0].sizes()) + " (one batch needs one size: enable do_center_crop)");
  }
  out.pixel_values = at::stack(planar);
  return out;
}

at::Tensor vae_image_preprocess(const at::Tensor& rgb, int64_t height, int64_t width, PillowFilter filter) {
  check_u8_image(rgb, "vae_image_preprocess");
  require(rgb.size(2) == 3, "vae_image_preprocess: expected RGB pixels [H, W, 3], got " + shape_text(rgb.sizes()));
  const at::Tensor resized = pillow_resize(rgb, height, width, filter);
  return resized.permute({2, 0, 1}).unsqueeze(0).to(at::kFloat).div(255.0f).contiguous();
}

// ---- image files ---------------------------------------------------------------------------------------------------

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// A JPEG's frame header (SOFn): its size and component count, read before anything is decoded. Absent: not a JPEG
// (or no frame header found), left to the decoder.
struct JpegFrame {
  int64_t width = 0, height = 0, components = 0;
};
std::optional<JpegFrame> jpeg_frame(const std::vector<uint8_t>& b) {
  if (b.size() < 4 || b[0] != 0xFF || b[1] != 0xD8) return std::nullopt;
  size_t at = 2;
  while (at + 4 <= b.size()) {
    if (b[at] != 0xFF) return std::nullopt;
    const uint8_t marker = b[at + 1];
    if (marker == 0xFF) {  // fill byte
      ++at;
      continue;
    }
    const size_t length = (size_t{b[at + 2]} << 8) | b[at + 3];
    const bool sof = marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC;
    if (sof && at + 10 <= b.size()) {
      JpegFrame f;
      f.height = (int64_t{b[at + 5]} << 8) | b[at + 6];
      f.width = (int64_t{b[at + 7]} << 8) | b[at + 8];
      f.components = b[at + 9];
      return f;
    }
    if (marker == 0xDA || length < 2) return std::nullopt;  // scan data before a frame header: give up
    at += 2 + length;
  }
  return std::nullopt;
}

void check_side(int64_t height, int64_t width, const ImageLimits& limits, const std::string& what) {
  require(width <= limits.max_side && height <= limits.max_side,
          what + ": " + std::to_string(width) + "x" + std::to_string(height) + " pixels, larger than the limit " +
              std::to_string(limits.max_side) + "x" + std::to_string(limits.max_side));
  require(width >= limits.min_side && height >= limits.min_side,
          what + ": " + std::to_string(width) + "x" + std::to_string(height) + " pixels; an image needs at least " +
              std::to_string(limits.min_side) + " pixels on each side");
}

}  // namespace

at::Tensor decode_image(const std::vector<uint8_t>& bytes, const std::string& what, const ImageLimits& limits) {
  if (const auto frame = jpeg_frame(bytes)) {
    require(frame->components == 1 || frame->components == 3,
            what + ": a JPEG with " + std::to_string(frame->components) +
                " colour components (CMYK / YCCK); only grayscale and RGB (YCbCr) JPEGs are accepted");
    require(frame->width <= limits.max_side && frame->height <= limits.max_side,
            what + ": a " + std::to_string(frame->width) + "x" + std::to_string(frame->height) +
                " JPEG, larger than the limit " + std::to_string(limits.max_side) + "x" +
                std::to_string(limits.max_side) + " (refused before decoding)");
  }
  video::ReadLimits read;
  read.max_width = static_cast<int>(limits.max_side);
  read.max_height = static_cast<int>(limits.max_side);
  read.max_frames = 1;
  video::DecodedVideo decoded;
  try {
    decoded = video::read_video_bytes(bytes, read);  // a PNG's size is checked on its header first
  } catch (const video::VideoError& e) {
    throw std::invalid_argument(what + ": not a readable PNG/JPEG image (" + e.what() + ")");
  }
  require(decoded.info.frames == 1, what + ": no image could be decoded");
  const at::Tensor rgb = decoded.frames[0];
  check_side(rgb.size(0), rgb.size(1), limits, what);
  return rgb;
}

at::Tensor read_image(const std::string& path, const std::string& tensor_name, const ImageLimits& limits) {
  const std::string what = "image '" + path + "'";
  if (ends_with(path, ".safetensors")) {
    std::shared_ptr<safetensors::File> file;
    try {
      file = safetensors::File::open(path);
    } catch (const safetensors::FormatError& e) {
      throw std::invalid_argument(what + ": " + e.what());
    }
    require(file->contains(tensor_name), what + " holds no tensor `" + tensor_name + "`");
    const at::Tensor t = file->tensor(tensor_name);
    check_u8_image(t, what + " tensor `" + tensor_name + "`");
    check_side(t.size(0), t.size(1), limits, what);
    return t.clone();
  }
  std::ifstream in(path, std::ios::binary);
  require(static_cast<bool>(in), "cannot read " + what);
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return decode_image(bytes, what, limits);
}

}  // namespace skyreels::model
