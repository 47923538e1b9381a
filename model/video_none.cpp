// model/video_mp4.h without FFmpeg (a model-only build, -DSKYREELS_MODEL_ONLY=ON, on a machine without libavcodec):
// the pixel conversions work (video_pixels.cpp); writing or reading a video file throws a VideoError saying so, so
// every command that can take or give tensors (.safetensors) instead still works.
#include <ATen/ATen.h>

#include "model/video_mp4.h"

namespace skyreels::video {
namespace {

[[noreturn]] void no_ffmpeg(const std::string& what) {
  throw VideoError(what + ": this build has no FFmpeg (model-only build without libavcodec); use .safetensors");
}

}  // namespace

struct Mp4Writer::Impl {};

Mp4Writer::Mp4Writer(const std::string& path, int, int, const Mp4Options&) { no_ffmpeg("writing " + path); }
Mp4Writer::Mp4Writer(ByteSink, int, int, const Mp4Options&) { no_ffmpeg("writing an MP4 stream"); }
Mp4Writer::~Mp4Writer() = default;
void Mp4Writer::write_rgb(const at::Tensor&) { no_ffmpeg("Mp4Writer"); }
void Mp4Writer::write_video(const at::Tensor&) { no_ffmpeg("Mp4Writer"); }
void Mp4Writer::end_segment() { no_ffmpeg("Mp4Writer"); }
void Mp4Writer::finish() { no_ffmpeg("Mp4Writer"); }
int64_t Mp4Writer::frames_written() const { return 0; }
int64_t Mp4Writer::segments_emitted() const { return 0; }

void write_mp4(const std::string& path, const at::Tensor&, const Mp4Options&) { no_ffmpeg("writing " + path); }
std::vector<uint8_t> encode_mp4_segment(const at::Tensor&, const Mp4Options&) { no_ffmpeg("encoding an MP4"); }
std::vector<uint8_t> encode_png(const at::Tensor&, int) { no_ffmpeg("encoding a PNG"); }
DecodedVideo read_video(const std::string& path, const ReadLimits&) { no_ffmpeg("reading " + path); }
DecodedVideo read_video_bytes(const std::vector<uint8_t>&, const ReadLimits&) { no_ffmpeg("reading a video"); }

}  // namespace skyreels::video
