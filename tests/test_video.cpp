// MP4 output through FFmpeg: what the project writes must read back through libavformat as H.264 of the right size,
// frame count and fps, with frames close (PSNR) to the tensors that went in; streams and per-chunk segments too.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "model/video_mp4.h"
#include "tests/test_util.h"

namespace sv = skyreels::video;

namespace {

// A smooth moving colour field in [-1, 1], [3, T, H, W]: what a decoded video looks like to an encoder.
at::Tensor smooth_video(int64_t frames, int64_t height, int64_t width) {
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor t = at::arange(frames, opts).view({frames, 1, 1});
  const at::Tensor y = at::arange(height, opts).view({1, height, 1}) / static_cast<double>(height);
  const at::Tensor x = at::arange(width, opts).view({1, 1, width}) / static_cast<double>(width);
  const at::Tensor r = at::sin(6.0 * x + 0.15 * t) * 0.8;
  const at::Tensor g = at::cos(5.0 * y - 0.1 * t) * 0.7;
  const at::Tensor b = at::sin(3.0 * (x + y) + 0.05 * t) * 0.6 - 0.1;
  return at::stack(
      {r.expand({frames, height, width}), g.expand({frames, height, width}), b.expand({frames, height, width})});
}

bool starts_with_box(const std::vector<uint8_t>& bytes, size_t offset, const char* type) {
  return bytes.size() >= offset + 8 && std::memcmp(bytes.data() + offset + 4, type, 4) == 0;
}

}  // namespace

TEST(VideoConversion, MapsMinusOneToZeroAndOneTo255AndTruncatesLikeDiffusers) {
  // x -> clamp((x + 1) / 2, 0, 1) * 255 -> astype(uint8): 0 gives 127 (127.5 truncated), out of range clamps.
  const at::Tensor v = at::tensor({-1.0f, 1.0f, 0.0f, -2.0f, 3.0f, 0.999f}).view({1, 1, 1, 6}).expand({3, 1, 1, 6});
  const at::Tensor rgb = sv::to_rgb_uint8(v.contiguous());
  ASSERT_EQ(rgb.sizes(), (at::IntArrayRef{1, 1, 6, 3}));
  const std::vector<int> expected{0, 255, 127, 0, 255, 254};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(rgb[0][0][i][0].item<int>(), expected[i]) << "element " << i;
}

TEST(VideoConversion, RandomFramesKeepTheirChannelsAndEqualThePipelineFormula) {
  at::manual_seed(3);
  const at::Tensor v = at::randn({3, 2, 5, 7}) * 0.7;  // some values out of [-1, 1]
  const at::Tensor rgb = sv::to_rgb_uint8(v.narrow(3, 1, 6));  // a strided view, as the VAE worker may hand on
  const at::Tensor expected = ((v.narrow(3, 1, 6) * 0.5f + 0.5f).clamp(0.0, 1.0) * 255.0f).to(at::kByte);
  ASSERT_EQ(rgb.sizes(), (at::IntArrayRef{2, 5, 6, 3}));
  EXPECT_TRUE(rgb.is_contiguous());
  EXPECT_TRUE(at::equal(rgb, expected.permute({1, 2, 3, 0})));
}

TEST(VideoConversion, FromRgbIsTheInverseScale) {
  const at::Tensor rgb = at::tensor({0, 255, 51}, at::kByte).view({1, 1, 1, 3});
  const at::Tensor v = sv::from_rgb_uint8(rgb);
  EXPECT_NEAR(v[0][0][0][0].item<float>(), -1.0f, 1e-6);
  EXPECT_NEAR(v[1][0][0][0].item<float>(), 1.0f, 1e-6);
  EXPECT_NEAR(v[2][0][0][0].item<float>(), 51.0f / 255.0f * 2.0f - 1.0f, 1e-6);
}

TEST(Mp4File, ReadsBackAsH264WithTheRightSizeFramesFpsAndPsnrAbove35dB) {
  const at::Tensor video = smooth_video(17, 64, 96);
  const std::string path = skyreels::test::temp_dir("mp4") + "/smooth.mp4";
  sv::write_mp4(path, video);
  const sv::DecodedVideo back = sv::read_video(path);
  EXPECT_EQ(back.info.codec, "h264");
  EXPECT_EQ(back.info.pix_fmt, "yuv420p");
  EXPECT_EQ(back.info.width, 96);
  EXPECT_EQ(back.info.height, 64);
  EXPECT_EQ(back.info.frames, 17);
  EXPECT_DOUBLE_EQ(back.info.fps, 24.0);
  const double db = sv::psnr(back.frames, sv::to_rgb_uint8(video));
  EXPECT_GE(db, 35.0);
  // And against the float tensors themselves, on the 0..255 scale.
  const at::Tensor input_255 = ((video.permute({1, 2, 3, 0}) + 1.0) * 127.5).clamp(0, 255);
  EXPECT_GE(sv::psnr(back.frames.to(at::kFloat), input_255), 35.0);
}

TEST(Mp4File, HonoursFpsAndALowerQualityGivesASmallerFile) {
  const at::Tensor video = smooth_video(9, 32, 48);
  const std::string dir = skyreels::test::temp_dir("mp4-fps");
  sv::Mp4Options high;
  high.fps = 16;
  sv::Mp4Options low = high;
  low.crf = 40;
  sv::write_mp4(dir + "/high.mp4", video, high);
  sv::write_mp4(dir + "/low.mp4", video, low);
  EXPECT_DOUBLE_EQ(sv::read_video(dir + "/high.mp4").info.fps, 16.0);
  EXPECT_LT(std::filesystem::file_size(dir + "/low.mp4"), std::filesystem::file_size(dir + "/high.mp4"));
}

TEST(Mp4File, RejectsOddSizesAndMismatchedFrames) {
  const std::string dir = skyreels::test::temp_dir("mp4-bad");
  EXPECT_THROW(sv::Mp4Writer(dir + "/odd.mp4", 33, 32), sv::VideoError);
  sv::Mp4Writer writer(dir + "/ok.mp4", 32, 32);
  EXPECT_THROW(writer.write_rgb(at::zeros({1, 16, 32, 3}, at::kByte)), sv::VideoError);
  EXPECT_THROW(writer.write_rgb(at::zeros({1, 32, 32, 3}, at::kFloat)), sv::VideoError);
  writer.write_rgb(at::zeros({2, 32, 32, 3}, at::kByte));
  writer.finish();
  EXPECT_THROW(writer.write_rgb(at::zeros({1, 32, 32, 3}, at::kByte)), sv::VideoError);
  EXPECT_EQ(sv::read_video(dir + "/ok.mp4").info.frames, 2);
}

TEST(Mp4Stream, EmitsAnInitSegmentThenOneFragmentPerChunkThatDecodeAsTheyArrive) {
  const at::Tensor video = smooth_video(21, 48, 64);  // chunks of 5, 8, 8 frames
  std::vector<uint8_t> bytes;
  std::vector<size_t> boundaries;
  sv::Mp4Writer writer([&](const uint8_t* data, size_t size) { bytes.insert(bytes.end(), data, data + size); }, 64, 48);
  ASSERT_TRUE(starts_with_box(bytes, 0, "ftyp")) << "the init segment is emitted before any frame";
  boundaries.push_back(bytes.size());

  const std::vector<std::pair<int64_t, int64_t>> chunks{{0, 5}, {5, 8}, {13, 8}};
  int64_t frames_so_far = 0;
  for (const auto& [start, length] : chunks) {
    writer.write_video(video.narrow(1, start, length));
    writer.end_segment();
    ASSERT_TRUE(starts_with_box(bytes, boundaries.back(), "moof")) << "chunk at " << start << " starts a fragment";
    boundaries.push_back(bytes.size());
    frames_so_far += length;
    // What has arrived so far is a playable stream holding every frame written so far.
    const sv::DecodedVideo partial = sv::read_video_bytes(bytes);
    EXPECT_EQ(partial.info.frames, frames_so_far);
    EXPECT_EQ(partial.info.codec, "h264");
  }
  writer.finish();
  EXPECT_EQ(writer.segments_emitted(), 3);
  const sv::DecodedVideo whole = sv::read_video_bytes(bytes);
  EXPECT_EQ(whole.info.frames, 21);
  EXPECT_EQ(whole.info.width, 64);
  EXPECT_EQ(whole.info.height, 48);
  EXPECT_DOUBLE_EQ(whole.info.fps, 24.0);
  EXPECT_GE(sv::psnr(whole.frames, sv::to_rgb_uint8(video)), 35.0);
}

TEST(Mp4Segments, EachChunkIsASelfContainedMp4) {
  const at::Tensor video = smooth_video(13, 32, 48);
  const std::vector<std::pair<int64_t, int64_t>> chunks{{0, 5}, {5, 8}};
  for (const auto& [start, length] : chunks) {
    const at::Tensor chunk = video.narrow(1, start, length);
    const std::vector<uint8_t> segment = sv::encode_mp4_segment(chunk);
    const sv::DecodedVideo back = sv::read_video_bytes(segment);
    EXPECT_EQ(back.info.codec, "h264");
    EXPECT_EQ(back.info.frames, length);
    EXPECT_EQ(back.info.width, 48);
    EXPECT_EQ(back.info.height, 32);
    EXPECT_GE(sv::psnr(back.frames, sv::to_rgb_uint8(chunk)), 35.0);
  }
}

TEST(Mp4Reader, NamesTheFileItCannotOpen) {
  try {
    sv::read_video("/nonexistent/clip.mp4");
    FAIL() << "no exception";
  } catch (const sv::VideoError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/clip.mp4"), std::string::npos);
  }
}
