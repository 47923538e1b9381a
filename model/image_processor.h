// Images as the SkyReels-V2 image-to-video pipeline prepares them, with Pillow 9.4's own integer arithmetic:
// transformers' CLIPImageProcessor (convert_to_rgb, shortest-edge resize, centre crop, rescale, normalise) in front
// of the CLIP image encoder, and diffusers' VaeImageProcessor resize (Pillow LANCZOS) in front of the VAE.
//
// Images are uint8 [H, W, C] tensors, as numpy.array(PIL image) gives them (C = 3 RGB, 4 RGBA, 1 L, 2 LA).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace skyreels::model {

// Pillow's resampling filters, by their Image.Resampling numbers (preprocessor_config.json's "resample").
enum class PillowFilter { kNearest = 0, kLanczos = 1, kBilinear = 2, kBicubic = 3, kBox = 4, kHamming = 5 };
const char* pillow_filter_name(PillowFilter filter);
// Throws std::invalid_argument for NEAREST (not a convolution filter; no pipeline uses it) or an unknown number.
PillowFilter pillow_filter_from_int(int64_t resample);

// Pillow's Image.resize((width, height), filter) of an 8-bit image, bit for bit: ImagingResample's two separable
// passes (horizontal first), the filter's support widened by the scale when downscaling, coefficients normalised in
// double and turned into 22-bit fixed point, sums rounded and clipped to uint8 after each pass. The same size is a
// copy, as in Pillow. uint8 [H, W, C] -> uint8 [height, width, C].
at::Tensor pillow_resize(const at::Tensor& image, int64_t height, int64_t width, PillowFilter filter);

// transformers' convert_to_rgb (image_transforms.py), which is Pillow's convert("RGB") (what diffusers' load_image
// also does): RGB as it is, L and LA replicated to three channels, RGBA's alpha dropped (not composited: the
// alpha-compositing version belongs to other processors, e.g. Idefics2's). uint8 [H, W, C] -> uint8 [H, W, 3].
at::Tensor convert_to_rgb(const at::Tensor& image);

// transformers' center_crop of an [H, W, C] image: the (h, w) window at top = (H - h) // 2, left = (W - w) // 2;
// an image smaller than the window is first padded with zeros as transformers pads it.
at::Tensor center_crop(const at::Tensor& image, int64_t height, int64_t width);

// A CLIPImageProcessor's preprocessor_config.json. Defaults are CLIPImageProcessor's.
struct ClipImageProcessorConfig {
  bool do_convert_rgb = true;
  bool do_resize = true;
  int64_t shortest_edge = 224;              // size {"shortest_edge": n}; 0 when size gives height and width instead
  int64_t size_height = 0, size_width = 0;  // size {"height", "width"}
  PillowFilter resample = PillowFilter::kBicubic;
  bool do_center_crop = true;
  int64_t crop_height = 224, crop_width = 224;
  bool do_rescale = true;
  double rescale_factor = 1.0 / 255.0;
  bool do_normalize = true;
  std::array<double, 3> image_mean{0.48145466, 0.4578275, 0.40821073};  // OpenAI CLIP
  std::array<double, 3> image_std{0.26862954, 0.26130258, 0.27577711};

  // Throws std::invalid_argument naming the file and the field.
  static ClipImageProcessorConfig from_json(const std::string& text, const std::string& where);
  static ClipImageProcessorConfig from_file(const std::string& path);
};

// Where an image encoder's preprocessor_config.json is, as diffusers lays out a pipeline: <encoder>/image_processor,
// <encoder>/../image_processor (a pipeline's image_encoder/ and image_processor/ side by side), or the encoder's
// folder itself. "" when none has one.
std::string find_image_processor_dir(const std::string& encoder_path);

// The (height, width) transformers resizes an image of h x w to (get_resize_output_image_size).
std::array<int64_t, 2> clip_resize_size(const ClipImageProcessorConfig& config, int64_t height, int64_t width);

struct ClipPreprocessed {
  std::vector<at::Tensor> cropped;  // per image, uint8 [h, w, 3] after resize and crop
  at::Tensor pixel_values;          // float32 [N, 3, h, w], the encoder's input
};

// CLIPImageProcessor(images=[...], return_tensors="pt"): every image converted to RGB, resized, cropped, then
// (u8 as float64 * rescale_factor) as float32 and (x - mean) / std in float32, HWC -> CHW. Images of one call must
// come out of one size. Throws std::invalid_argument naming the image (by index) on a bad input.
ClipPreprocessed clip_preprocess(const ClipImageProcessorConfig& config, const std::vector<at::Tensor>& images);

// diffusers' VaeImageProcessor.preprocess of a Pillow RGB image for the VAE, before its 2x - 1: resized to
// height x width with Pillow (`filter`; LANCZOS is VaeImageProcessor's default), then np.float32(u8) / 255.
// uint8 [H, W, 3] -> float32 [1, 3, height, width] in [0, 1].
at::Tensor vae_image_preprocess(const at::Tensor& rgb, int64_t height, int64_t width,
                                PillowFilter filter = PillowFilter::kLanczos);

// ---- image files ---------------------------------------------------------------------------------------------------

// Bounds on images from outside. A side above max_side is refused on the file's header, before anything is decoded;
// a side below min_side is refused after decoding (a 1-pixel image holds no picture to condition on).
struct ImageLimits {
  int64_t max_side = 8192;
  int64_t min_side = 2;
};

// A PNG or JPEG decoded to 8-bit RGB (alpha dropped, as Pillow's convert("RGB") drops it) -> uint8 [H, W, 3]; or a
// .safetensors file holding `tensor_name`: uint8 [H, W, C] pixels as numpy.array(PIL image) gives them (C = 1, 2, 3
// or 4, kept as they are; convert_to_rgb makes them RGB). CMYK / YCCK JPEGs are refused (their colour conversion is
// decoder-specific).
// Errors are std::invalid_argument naming the file.
at::Tensor read_image(const std::string& path, const std::string& tensor_name = "image",
                      const ImageLimits& limits = {});
// The bytes of a PNG / JPEG, decoded within `limits`; errors name `what`.
at::Tensor decode_image(const std::vector<uint8_t>& bytes, const std::string& what, const ImageLimits& limits = {});

}  // namespace skyreels::model
