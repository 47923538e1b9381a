#include "model/video_mp4.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/error.h>
#include <libavutil/imgutils.h>
#include <libavutil/opt.h>
#include <libswscale/swscale.h>
}

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>

namespace skyreels::video {
namespace {

std::string av_error(int code) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {0};
  av_strerror(code, buf, sizeof(buf));
  return buf;
}

void check(int code, const std::string& what) {
  if (code < 0) throw VideoError(what + ": " + av_error(code));
}

// libx264 prints per-file statistics at info level; keep FFmpeg to errors unless someone asked for more.
void quiet_ffmpeg() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (av_log_get_level() == AV_LOG_INFO) av_log_set_level(AV_LOG_ERROR);
  });
}

// BT.601 limited-range YUV, what FFmpeg's command line (and so imageio) produces from RGB by default; tagged in
// the stream so players do not guess.
constexpr int kSwsColorspace = SWS_CS_ITU601;

#if LIBAVFORMAT_VERSION_MAJOR >= 61
using WriteBuffer = const uint8_t*;
#else
using WriteBuffer = uint8_t*;
#endif

at::Tensor as_frames_hwc(const at::Tensor& frames, int width, int height) {
  at::Tensor f = frames.dim() == 3 ? frames.unsqueeze(0) : frames;
  if (f.dim() != 4 || f.size(3) != 3 || f.scalar_type() != at::kByte) {
    throw VideoError("Mp4Writer: frames must be uint8 [T, H, W, 3], got " +
                     std::string(c10::toString(frames.scalar_type())) + " of " + std::to_string(frames.dim()) +
                     " dims");
  }
  if (f.size(1) != height || f.size(2) != width) {
    throw VideoError("Mp4Writer: frame size " + std::to_string(f.size(2)) + "x" + std::to_string(f.size(1)) +
                     " differs from the stream's " + std::to_string(width) + "x" + std::to_string(height));
  }
  return f.to(at::kCPU).contiguous();
}

}  // namespace

// =================================================================================================================
// Writer
struct Mp4Writer::Impl {
  int width = 0, height = 0;
  Mp4Options options;
  ByteSink sink;  // set in stream mode
  AVFormatContext* fmt = nullptr;
  AVCodecContext* enc = nullptr;
  AVStream* stream = nullptr;
  SwsContext* sws = nullptr;
  AVFrame* frame = nullptr;
  AVPacket* packet = nullptr;
  AVIOContext* custom_io = nullptr;
  bool file_opened = false;
  bool header_written = false;
  bool finished = false;
  bool force_key = false;
  int64_t next_pts = 0;
  int64_t frames = 0;
  int64_t packets = 0;
  int64_t frames_in_segment = 0;
  int64_t segments = 0;

  ~Impl() { release(); }

  void release() {
    sws_freeContext(sws);
    sws = nullptr;
    av_frame_free(&frame);
    av_packet_free(&packet);
    avcodec_free_context(&enc);
    if (fmt != nullptr && file_opened) avio_closep(&fmt->pb);
    file_opened = false;
    if (custom_io != nullptr) {
      av_freep(&custom_io->buffer);
      avio_context_free(&custom_io);
    }
    avformat_free_context(fmt);
    fmt = nullptr;
  }

  static int write_to_sink(void* opaque, WriteBuffer data, int size) {
    auto* self = static_cast<Impl*>(opaque);
    try {
      self->sink(data, static_cast<size_t>(size));
    } catch (const std::exception& e) {
      spdlog::error("Mp4Writer: the byte sink failed: {}", e.what());
      return AVERROR_EXTERNAL;
    }
    return size;
  }

  void open(const std::string& path) {
    quiet_ffmpeg();
    if (width <= 0 || height <= 0 || width % 2 != 0 || height % 2 != 0) {
      throw VideoError("Mp4Writer: width and height must be positive and even for yuv420p, got " +
                       std::to_string(width) + "x" + std::to_string(height));
    }
    if (options.fps <= 0) throw VideoError("Mp4Writer: fps must be > 0, got " + std::to_string(options.fps));
    if (options.crf < 0 || options.crf > 51) {
      throw VideoError("Mp4Writer: crf must be in 0..51, got " + std::to_string(options.crf));
    }
    const bool to_sink = static_cast<bool>(sink);
    if (to_sink) options.fragmented = true;

    check(avformat_alloc_output_context2(&fmt, nullptr, "mp4", to_sink ? nullptr : path.c_str()),
          "Mp4Writer: cannot create an mp4 muxer");
    const AVCodec* codec = avcodec_find_encoder_by_name("libx264");
    if (codec == nullptr) throw VideoError("Mp4Writer: this FFmpeg has no libx264 encoder");
    stream = avformat_new_stream(fmt, nullptr);
    enc = avcodec_alloc_context3(codec);
    if (stream == nullptr || enc == nullptr) throw VideoError("Mp4Writer: out of memory");
    configure_encoder(codec);
    check(avcodec_parameters_from_context(stream->codecpar, enc), "Mp4Writer: codec parameters");
    stream->time_base = enc->time_base;
    stream->avg_frame_rate = enc->framerate;

    if (to_sink) {
      constexpr int kBufferSize = 1 << 16;
      auto* buffer = static_cast<unsigned char*>(av_malloc(kBufferSize));
      custom_io = avio_alloc_context(buffer, kBufferSize, 1, this, nullptr, &Impl::write_to_sink, nullptr);
      if (custom_io == nullptr) throw VideoError("Mp4Writer: out of memory");
      custom_io->seekable = 0;
      fmt->pb = custom_io;
      fmt->flags |= AVFMT_FLAG_CUSTOM_IO;
    } else {
      check(avio_open(&fmt->pb, path.c_str(), AVIO_FLAG_WRITE), "Mp4Writer: cannot open '" + path + "' for writing");
      file_opened = true;
    }

    AVDictionary* mux = nullptr;
    // frag_custom: a fragment ends exactly when end_segment() says so; empty_moov: the init segment needs no frames.
    av_dict_set(&mux, "movflags", options.fragmented ? "empty_moov+default_base_moof+frag_custom" : "faststart", 0);
    const int rc = avformat_write_header(fmt, &mux);
    av_dict_free(&mux);
    check(rc, "Mp4Writer: cannot write the MP4 header" + (to_sink ? std::string() : " of '" + path + "'"));
    header_written = true;
    avio_flush(fmt->pb);

    frame = av_frame_alloc();
    packet = av_packet_alloc();
    if (frame == nullptr || packet == nullptr) throw VideoError("Mp4Writer: out of memory");
    frame->format = AV_PIX_FMT_YUV420P;
    frame->width = width;
    frame->height = height;
    check(av_frame_get_buffer(frame, 0), "Mp4Writer: frame buffer");
    sws = sws_getContext(width, height, AV_PIX_FMT_RGB24, width, height, AV_PIX_FMT_YUV420P,
                         SWS_BICUBIC | SWS_ACCURATE_RND, nullptr, nullptr, nullptr);
    if (sws == nullptr) throw VideoError("Mp4Writer: cannot create the RGB -> YUV converter");
    const int* coefficients = sws_getCoefficients(kSwsColorspace);
    sws_setColorspaceDetails(sws, coefficients, /*srcRange=*/1, coefficients, /*dstRange=*/0, 0, 1 << 16, 1 << 16);
  }

  void configure_encoder(const AVCodec* codec) {
    enc->width = width;
    enc->height = height;
    enc->pix_fmt = AV_PIX_FMT_YUV420P;
    enc->time_base = AVRational{1, options.fps};
    enc->framerate = AVRational{options.fps, 1};
    enc->color_range = AVCOL_RANGE_MPEG;
    enc->colorspace = AVCOL_SPC_SMPTE170M;
    if (fmt->oformat->flags & AVFMT_GLOBALHEADER) enc->flags |= AV_CODEC_FLAG_GLOBAL_HEADER;
    AVDictionary* opts = nullptr;
    av_dict_set(&opts, "crf", std::to_string(options.crf).c_str(), 0);
    av_dict_set(&opts, "preset", options.preset.c_str(), 0);
    if (options.fragmented) {
      // No B-frames, no look-ahead, no frame threads: every frame's packet is out before the next frame comes, so
      // a fragment holds exactly the frames written since the last one. forced-idr: segments start with an IDR.
      av_dict_set(&opts, "tune", "zerolatency", 0);
      av_dict_set(&opts, "forced-idr", "1", 0);
    }
    const int rc = avcodec_open2(enc, codec, &opts);
    av_dict_free(&opts);
    check(rc,
          "Mp4Writer: cannot open libx264 (preset '" + options.preset + "', crf " + std::to_string(options.crf) + ")");
  }

  void drain(bool flushing) {
    while (true) {
      const int rc = avcodec_receive_packet(enc, packet);
      if (rc == AVERROR(EAGAIN) || rc == AVERROR_EOF) return;
      check(rc, "Mp4Writer: encoding failed");
      av_packet_rescale_ts(packet, enc->time_base, stream->time_base);
      packet->stream_index = stream->index;
      ++packets;
      const int wrc = av_write_frame(fmt, packet);
      av_packet_unref(packet);
      check(wrc, flushing ? "Mp4Writer: writing the last packets failed" : "Mp4Writer: writing a packet failed");
    }
  }

  void encode(const uint8_t* rgb) {
    check(av_frame_make_writable(frame), "Mp4Writer: frame buffer");
    const uint8_t* src[1] = {rgb};
    const int stride[1] = {3 * width};
    sws_scale(sws, src, stride, 0, height, frame->data, frame->linesize);
    frame->pts = next_pts++;
    frame->pict_type = force_key ? AV_PICTURE_TYPE_I : AV_PICTURE_TYPE_NONE;
    force_key = false;
    check(avcodec_send_frame(enc, frame), "Mp4Writer: encoding failed");
    drain(false);
    ++frames;
    ++frames_in_segment;
  }

  void end_segment() {
    if (!options.fragmented || frames_in_segment == 0) return;
    if (packets != frames) {
      throw VideoError("Mp4Writer: the encoder still holds " + std::to_string(frames - packets) +
                       " frame(s) at a segment boundary");
    }
    check(av_write_frame(fmt, nullptr), "Mp4Writer: cannot close a fragment");
    avio_flush(fmt->pb);
    frames_in_segment = 0;
    force_key = true;
    ++segments;
  }

  void finish() {
    if (finished) return;
    finished = true;
    check(avcodec_send_frame(enc, nullptr), "Mp4Writer: flushing the encoder failed");
    drain(true);
    if (options.fragmented && frames_in_segment > 0) ++segments;
    check(av_write_trailer(fmt), "Mp4Writer: cannot write the MP4 trailer");
    avio_flush(fmt->pb);
    release();
  }

  void require_open() const {
    if (finished) throw VideoError("Mp4Writer: write after finish()");
  }
};

Mp4Writer::Mp4Writer(const std::string& path, int width, int height, const Mp4Options& options)
    : impl_(std::make_unique<Impl>()) {
  impl_->width = width;
  impl_->height = height;
  impl_->options = options;
  impl_->open(path);
}

Mp4Writer::Mp4Writer(ByteSink sink, int width, int height, const Mp4Options& options)
    : impl_(std::make_unique<Impl>()) {
  if (!sink) throw VideoError("Mp4Writer: empty byte sink");
  impl_->width = width;
  impl_->height = height;
  impl_->options = options;
  impl_->sink = std::move(sink);
  impl_->open("");
}

Mp4Writer::~Mp4Writer() {
  if (impl_ && !impl_->finished && impl_->header_written) {
    try {
      impl_->finish();
    } catch (const std::exception& e) {
      spdlog::error("Mp4Writer: finishing in the destructor failed: {}", e.what());
    }
  }
}

void Mp4Writer::write_rgb(const at::Tensor& frames) {
  impl_->require_open();
  const at::Tensor f = as_frames_hwc(frames, impl_->width, impl_->height);
  const auto* base = f.data_ptr<uint8_t>();
  const int64_t frame_bytes = static_cast<int64_t>(impl_->width) * impl_->height * 3;
  for (int64_t t = 0; t < f.size(0); ++t) impl_->encode(base + t * frame_bytes);
}

void Mp4Writer::write_video(const at::Tensor& video) { write_rgb(to_rgb_uint8(video)); }

void Mp4Writer::end_segment() {
  impl_->require_open();
  impl_->end_segment();
}

void Mp4Writer::finish() { impl_->finish(); }
int64_t Mp4Writer::frames_written() const { return impl_->frames; }
int64_t Mp4Writer::segments_emitted() const { return impl_->segments; }

void write_mp4(const std::string& path, const at::Tensor& video, const Mp4Options& options) {
  if (video.dim() != 4) throw VideoError("write_mp4: expected a video [3, T, H, W]");
  Mp4Writer writer(path, static_cast<int>(video.size(3)), static_cast<int>(video.size(2)), options);
  writer.write_video(video);
  writer.finish();
}

std::vector<uint8_t> encode_png(const at::Tensor& rgb, int compression_level) {
  quiet_ffmpeg();
  if (rgb.dim() != 3 || rgb.size(2) != 3 || rgb.scalar_type() != at::kByte) {
    throw VideoError("encode_png: expected uint8 [H, W, 3], got " + std::to_string(rgb.dim()) + " dims");
  }
  const at::Tensor image = rgb.contiguous();
  const int height = static_cast<int>(image.size(0)), width = static_cast<int>(image.size(1));
  const AVCodec* codec = avcodec_find_encoder(AV_CODEC_ID_PNG);
  if (codec == nullptr) throw VideoError("encode_png: this FFmpeg has no PNG encoder");
  AVCodecContext* ctx = avcodec_alloc_context3(codec);
  AVFrame* frame = av_frame_alloc();
  AVPacket* packet = av_packet_alloc();
  std::vector<uint8_t> out;
  try {
    if (ctx == nullptr || frame == nullptr || packet == nullptr) throw VideoError("encode_png: out of memory");
    ctx->width = width;
    ctx->height = height;
    ctx->pix_fmt = AV_PIX_FMT_RGB24;
    ctx->time_base = AVRational{1, 1};
    if (compression_level >= 0) ctx->compression_level = std::min(compression_level, 9);
    check(avcodec_open2(ctx, codec, nullptr), "encode_png: cannot open the encoder");
    frame->format = AV_PIX_FMT_RGB24;
    frame->width = width;
    frame->height = height;
    check(av_frame_get_buffer(frame, 0), "encode_png: frame buffer");
    const uint8_t* src = image.data_ptr<uint8_t>();
    for (int y = 0; y < height; ++y) {
      std::memcpy(frame->data[0] + static_cast<ptrdiff_t>(y) * frame->linesize[0], src + static_cast<ptrdiff_t>(y) * width * 3,
                  static_cast<size_t>(width) * 3);
    }
    check(avcodec_send_frame(ctx, frame), "encode_png: encoding");
    check(avcodec_send_frame(ctx, nullptr), "encode_png: flushing");
    while (avcodec_receive_packet(ctx, packet) == 0) {
      out.insert(out.end(), packet->data, packet->data + packet->size);
      av_packet_unref(packet);
    }
  } catch (...) {
    av_packet_free(&packet);
    av_frame_free(&frame);
    avcodec_free_context(&ctx);
    throw;
  }
  av_packet_free(&packet);
  av_frame_free(&frame);
  avcodec_free_context(&ctx);
  return out;
}

std::vector<uint8_t> encode_mp4_segment(const at::Tensor& video, const Mp4Options& options) {
  if (video.dim() != 4) throw VideoError("encode_mp4_segment: expected a video [3, T, H, W]");
  std::vector<uint8_t> bytes;
  Mp4Writer writer([&bytes](const uint8_t* data, size_t size) { bytes.insert(bytes.end(), data, data + size); },
                   static_cast<int>(video.size(3)), static_cast<int>(video.size(2)), options);
  writer.write_video(video);
  writer.finish();
  return bytes;
}

// =================================================================================================================
// Reader
namespace {

struct MemoryInput {
  const std::vector<uint8_t>* bytes = nullptr;
  int64_t pos = 0;

  static int read(void* opaque, uint8_t* buf, int size) {
    auto* self = static_cast<MemoryInput*>(opaque);
    const int64_t left = static_cast<int64_t>(self->bytes->size()) - self->pos;
    if (left <= 0) return AVERROR_EOF;
    const int n = static_cast<int>(std::min<int64_t>(left, size));
    std::memcpy(buf, self->bytes->data() + self->pos, static_cast<size_t>(n));
    self->pos += n;
    return n;
  }

  static int64_t seek(void* opaque, int64_t offset, int whence) {
    auto* self = static_cast<MemoryInput*>(opaque);
    const auto size = static_cast<int64_t>(self->bytes->size());
    if (whence & AVSEEK_SIZE) return size;
    int64_t target = offset;
    switch (whence & ~AVSEEK_FORCE) {
      case SEEK_SET:
        target = offset;
        break;
      case SEEK_CUR:
        target = self->pos + offset;
        break;
      case SEEK_END:
        target = size + offset;
        break;
      default:
        return AVERROR(EINVAL);
    }
    if (target < 0 || target > size) return AVERROR(EINVAL);
    self->pos = target;
    return target;
  }
};

// PNG's IHDR gives the size before anything is decoded.
void check_png_header(const std::vector<uint8_t>& b, const ReadLimits& limits, const std::string& name) {
  static const uint8_t kMagic[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (b.size() < 24 || std::memcmp(b.data(), kMagic, 8) != 0) return;
  auto be32 = [&](size_t at) {
    return (uint64_t{b[at]} << 24) | (uint64_t{b[at + 1]} << 16) | (uint64_t{b[at + 2]} << 8) | uint64_t{b[at + 3]};
  };
  const uint64_t width = be32(16), height = be32(20);
  if ((limits.max_width > 0 && width > static_cast<uint64_t>(limits.max_width)) ||
      (limits.max_height > 0 && height > static_cast<uint64_t>(limits.max_height))) {
    throw VideoError("read_video: " + name + " is a " + std::to_string(width) + "x" + std::to_string(height) +
                     " PNG, larger than the limit " + std::to_string(limits.max_width) + "x" +
                     std::to_string(limits.max_height));
  }
}

class Reader {
 public:
  explicit Reader(const ReadLimits& limits) : limits_(limits) {}

  ~Reader() {
    sws_freeContext(sws_);
    av_frame_free(&frame_);
    av_packet_free(&packet_);
    avcodec_free_context(&dec_);
    avformat_close_input(&fmt_);
    if (io_ != nullptr) {
      av_freep(&io_->buffer);
      avio_context_free(&io_);
    }
  }

  DecodedVideo read_file(const std::string& path) {
    name_ = "'" + path + "'";
    check(avformat_open_input(&fmt_, path.c_str(), nullptr, nullptr), "read_video: cannot open " + name_);
    return decode_all();
  }

  DecodedVideo read_bytes(const std::vector<uint8_t>& bytes) {
    name_ = "a buffer of " + std::to_string(bytes.size()) + " bytes";
    check_png_header(bytes, limits_, name_);
    input_.bytes = &bytes;
    constexpr int kBufferSize = 1 << 16;
    auto* buffer = static_cast<unsigned char*>(av_malloc(kBufferSize));
    io_ = avio_alloc_context(buffer, kBufferSize, 0, &input_, &MemoryInput::read, nullptr, &MemoryInput::seek);
    fmt_ = avformat_alloc_context();
    if (io_ == nullptr || fmt_ == nullptr) throw VideoError("read_video: out of memory");
    fmt_->pb = io_;
    fmt_->flags |= AVFMT_FLAG_CUSTOM_IO;
    check(avformat_open_input(&fmt_, nullptr, nullptr, nullptr), "read_video: cannot open " + name_);
    return decode_all();
  }

 private:
  // Input with limits comes from outside (a request): damaged data is an error, not concealed.
  bool untrusted() const { return limits_.max_width > 0 || limits_.max_height > 0 || limits_.max_frames > 0; }

  // For the decoders' own check, which counts the stride-aligned width (up to 64 more pixels) and padding: the exact
  // bound is checked on the header and on every decoded frame.
  int64_t max_pixels() const {
    constexpr int64_t kSlack = 256;
    return limits_.max_width > 0 && limits_.max_height > 0
               ? (int64_t{limits_.max_width} + kSlack) * (int64_t{limits_.max_height} + kSlack)
               : 0;
  }

  // What the container header says, before any frame is decoded (MP4: the sample table).
  void check_header_limits() const {
    for (unsigned i = 0; i < fmt_->nb_streams; ++i) {
      const AVStream* s = fmt_->streams[i];
      check_size(s->codecpar->width, s->codecpar->height);
      if (limits_.max_frames > 0 && s->codecpar->codec_type == AVMEDIA_TYPE_VIDEO &&
          s->nb_frames > limits_.max_frames) {
        throw VideoError("read_video: " + name_ + " has " + std::to_string(s->nb_frames) +
                         " frames, more than the limit " + std::to_string(limits_.max_frames));
      }
    }
  }

  void check_size(int width, int height) const {
    if ((limits_.max_width > 0 && width > limits_.max_width) ||
        (limits_.max_height > 0 && height > limits_.max_height)) {
      throw VideoError("read_video: " + name_ + " is " + std::to_string(width) + "x" + std::to_string(height) +
                       ", larger than the limit " + std::to_string(limits_.max_width) + "x" +
                       std::to_string(limits_.max_height));
    }
  }

  void find_stream_info() {
    // The probe decodes a frame or two: bound those decoders too.
    std::vector<AVDictionary*> options(fmt_->nb_streams, nullptr);
    if (max_pixels() > 0) {
      for (auto& o : options) av_dict_set_int(&o, "max_pixels", max_pixels(), 0);
    }
    const int rc = avformat_find_stream_info(fmt_, options.empty() ? nullptr : options.data());
    for (auto& o : options) av_dict_free(&o);
    check(rc, "read_video: no stream info in " + name_);
  }

  DecodedVideo decode_all() {
    quiet_ffmpeg();
    check_header_limits();
    find_stream_info();
    check_header_limits();
    const AVCodec* codec = nullptr;
    const int index = av_find_best_stream(fmt_, AVMEDIA_TYPE_VIDEO, -1, -1, &codec, 0);
    check(index, "read_video: no video stream in " + name_);
    AVStream* stream = fmt_->streams[index];
    dec_ = avcodec_alloc_context3(codec);
    if (dec_ == nullptr) throw VideoError("read_video: out of memory");
    check(avcodec_parameters_to_context(dec_, stream->codecpar), "read_video: codec parameters");
    if (max_pixels() > 0) dec_->max_pixels = max_pixels();
    check(avcodec_open2(dec_, codec, nullptr), "read_video: cannot open the decoder for " + name_);

    DecodedVideo out;
    out.info.codec = avcodec_get_name(stream->codecpar->codec_id);
    out.info.container = fmt_->iformat->name;
    out.info.width = stream->codecpar->width;
    out.info.height = stream->codecpar->height;
    const char* pix = av_get_pix_fmt_name(static_cast<AVPixelFormat>(stream->codecpar->format));
    out.info.pix_fmt = pix != nullptr ? pix : "";
    const AVRational rate = stream->avg_frame_rate.num != 0 ? stream->avg_frame_rate : stream->r_frame_rate;
    out.info.fps = rate.den != 0 ? av_q2d(rate) : 0.0;

    frame_ = av_frame_alloc();
    packet_ = av_packet_alloc();
    if (frame_ == nullptr || packet_ == nullptr) throw VideoError("read_video: out of memory");
    int read = 0;
    while ((read = av_read_frame(fmt_, packet_)) >= 0) {
      if (untrusted() && (packet_->flags & AV_PKT_FLAG_CORRUPT) != 0) {
        av_packet_unref(packet_);
        throw VideoError("read_video: " + name_ + " is damaged (a corrupt packet)");
      }
      if (packet_->stream_index == index) {
        const int rc = avcodec_send_packet(dec_, packet_);
        av_packet_unref(packet_);
        check(rc, "read_video: decoding " + name_ + " failed");
        receive_frames();
      } else {
        av_packet_unref(packet_);
      }
    }
    if (untrusted() && read != AVERROR_EOF) check(read, "read_video: " + name_ + " is truncated or damaged");
    check(avcodec_send_packet(dec_, nullptr), "read_video: flushing the decoder failed");
    receive_frames();
    out.info.frames = decoded_;  // all of them, also when keep_last kept fewer in `frames`
    out.frames = frames_.empty() ? at::empty({0, out.info.height, out.info.width, 3}, at::kByte) : at::stack(frames_);
    return out;
  }

  void receive_frames() {
    while (true) {
      const int rc = avcodec_receive_frame(dec_, frame_);
      if (rc == AVERROR(EAGAIN) || rc == AVERROR_EOF) return;
      check(rc, "read_video: decoding " + name_ + " failed");
      check_size(frame_->width, frame_->height);
      if (limits_.max_frames > 0 && decoded_ >= limits_.max_frames) {
        throw VideoError("read_video: " + name_ + " has more than " + std::to_string(limits_.max_frames) +
                         " frames (the limit)");
      }
      if (limits_.keep_frames.empty() ||
          std::binary_search(limits_.keep_frames.begin(), limits_.keep_frames.end(), decoded_)) {
        frames_.push_back(to_rgb(frame_));
      }
      ++decoded_;
      if (limits_.keep_last > 0 && static_cast<int64_t>(frames_.size()) > limits_.keep_last) {
        frames_.erase(frames_.begin());
      }
      av_frame_unref(frame_);
    }
  }

  at::Tensor to_rgb(const AVFrame* f) {
    sws_ = sws_getCachedContext(sws_, f->width, f->height, static_cast<AVPixelFormat>(f->format), f->width, f->height,
                                AV_PIX_FMT_RGB24, SWS_BICUBIC | SWS_ACCURATE_RND | SWS_FULL_CHR_H_INT, nullptr, nullptr,
                                nullptr);
    if (sws_ == nullptr) throw VideoError("read_video: cannot convert frames of " + name_ + " to RGB");
    const int cs = f->colorspace == AVCOL_SPC_BT709 ? SWS_CS_ITU709 : kSwsColorspace;
    const int full_range = f->color_range == AVCOL_RANGE_JPEG ? 1 : 0;
    sws_setColorspaceDetails(sws_, sws_getCoefficients(cs), full_range, sws_getCoefficients(SWS_CS_DEFAULT), 1, 0,
                             1 << 16, 1 << 16);
    at::Tensor rgb = at::empty({f->height, f->width, 3}, at::kByte);
    uint8_t* dst[1] = {rgb.data_ptr<uint8_t>()};
    const int stride[1] = {3 * f->width};
    sws_scale(sws_, f->data, f->linesize, 0, f->height, dst, stride);
    return rgb;
  }

  ReadLimits limits_;
  std::string name_;
  MemoryInput input_;
  AVIOContext* io_ = nullptr;
  AVFormatContext* fmt_ = nullptr;
  AVCodecContext* dec_ = nullptr;
  AVFrame* frame_ = nullptr;
  AVPacket* packet_ = nullptr;
  SwsContext* sws_ = nullptr;
  std::vector<at::Tensor> frames_;
  int64_t decoded_ = 0;
};

}  // namespace

DecodedVideo read_video(const std::string& path, const ReadLimits& limits) { return Reader(limits).read_file(path); }
DecodedVideo read_video_bytes(const std::vector<uint8_t>& bytes, const ReadLimits& limits) {
  return Reader(limits).read_bytes(bytes);
}

}  // namespace skyreels::video
