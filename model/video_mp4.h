// H.264 MP4 through Debian's FFmpeg libraries (libx264, yuv420p): whole files, fragmented streams emitted segment by
// segment to a byte callback (for a server that sends each chunk as it is decoded), self-contained per-chunk
// segments, and a reader (codec, size, frame count, fps, decoded RGB frames) for tests and `skyreels encode`.
//
// Pixels are converted as diffusers does before export_to_video: [-1, 1] -> clamp((x + 1) / 2, 0, 1) -> x * 255
// truncated to uint8 (numpy's astype(np.uint8)). The default quality is SkyReels' writer: imageio quality=8, i.e.
// libx264 CRF int((1 - 8/10) * 51) = 10, at 24 fps.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/video_shape.h"

namespace skyreels::video {

class VideoError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// [C=3, T, H, W] float in [-1, 1] (one batch item of a decoded video) -> uint8 [T, H, W, 3], diffusers' conversion.
at::Tensor to_rgb_uint8(const at::Tensor& video);
// uint8 [T, H, W, 3] -> float32 [3, T, H, W] in [-1, 1] (x / 255 * 2 - 1, diffusers' VideoProcessor).
at::Tensor from_rgb_uint8(const at::Tensor& frames);

struct Mp4Options {
  int fps = static_cast<int>(model::kDefaultFps);
  int crf = 10;                   // libx264 constant rate factor, 0 (lossless) .. 51
  std::string preset = "medium";  // libx264 preset
  // Fragmented MP4 (an init segment, then one moof+mdat per end_segment()). Writers to a ByteSink always are.
  bool fragmented = false;
};

// Receives the bytes of a stream in order; their concatenation is a valid (fragmented) MP4.
using ByteSink = std::function<void(const uint8_t* data, size_t size)>;

class Mp4Writer {
 public:
  // A file. Regular MP4s get their index moved to the front (faststart); fragmented ones are playable while they
  // grow. Width and height must be even (yuv420p).
  Mp4Writer(const std::string& path, int width, int height, const Mp4Options& options = {});
  // A stream: fragmented MP4 to `sink`. The init segment (ftyp+moov) is emitted at once; each end_segment() emits
  // every frame written since the previous one as one fragment starting with a key frame, so a client can play
  // the stream as it arrives. Encoded without B-frames or look-ahead so a segment never waits for later frames.
  Mp4Writer(ByteSink sink, int width, int height, const Mp4Options& options = {});
  ~Mp4Writer();  // finishes if finish() was not called (errors are logged, not thrown)
  Mp4Writer(const Mp4Writer&) = delete;
  Mp4Writer& operator=(const Mp4Writer&) = delete;

  void write_rgb(const at::Tensor& frames);   // uint8 [T, H, W, 3] (or [H, W, 3])
  void write_video(const at::Tensor& video);  // float [3, T, H, W] in [-1, 1]
  // Fragmented output: closes the current fragment (sink mode: hands its bytes to the sink). Does nothing for a
  // regular MP4 or when no frame was written since the last segment.
  void end_segment();
  // Flushes the encoder and writes the trailer. Idempotent; no writes afterwards.
  void finish();

  int64_t frames_written() const;
  int64_t segments_emitted() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A whole video ([3, T, H, W] in [-1, 1]) to a file.
void write_mp4(const std::string& path, const at::Tensor& video, const Mp4Options& options = {});
// One self-contained MP4 (fragmented, playable on its own) in memory: what a server sends per chunk when each
// chunk is its own file.
std::vector<uint8_t> encode_mp4_segment(const at::Tensor& video, const Mp4Options& options = {});
// One uint8 RGB image [H, W, 3] as a PNG file's bytes; `compression_level` 0..9 is zlib's (-1: FFmpeg's default;
// previews take a fast level: the same pixels, made in less time, a little larger).
std::vector<uint8_t> encode_png(const at::Tensor& rgb, int compression_level = -1);

struct VideoInfo {
  std::string codec;      // "h264"
  std::string container;  // e.g. "mov,mp4,m4a,3gp,3g2,mj2"
  std::string pix_fmt;    // "yuv420p"
  int width = 0;
  int height = 0;
  int64_t frames = 0;  // decoded frames
  double fps = 0.0;    // average frame rate of the stream
};

struct DecodedVideo {
  VideoInfo info;
  at::Tensor frames;  // uint8 [T, H, W, 3] RGB
};

// Bounds for decoding untrusted input (0 = none). Width x height and the frame count are checked on the container's
// header before any frame is decoded, and the decoders refuse larger frames themselves (max_pixels), so a hostile
// file cannot make the reader allocate more than about max_width x max_height x max_frames x 3 bytes.
struct ReadLimits {
  int max_width = 0;
  int max_height = 0;
  int64_t max_frames = 0;
  int64_t keep_last = 0;  // > 0: keep only the last keep_last decoded frames (memory bounded by them, not the file)
  std::vector<int64_t> keep_frames;  // non-empty: keep only these frame indices (ascending); the others are dropped
};

// Any container/codec FFmpeg reads: MP4 videos, and PNG / JPEG images as one-frame videos.
DecodedVideo read_video(const std::string& path, const ReadLimits& limits = {});
DecodedVideo read_video_bytes(const std::vector<uint8_t>& bytes, const ReadLimits& limits = {});

// Peak signal-to-noise ratio in dB of two uint8 (or 0..255 float) tensors of one shape; +inf when equal.
double psnr(const at::Tensor& a, const at::Tensor& b);

}  // namespace skyreels::video
