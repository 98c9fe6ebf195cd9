// Writes the seed corpus of the fuzz targets (tests/fuzz/corpus/TARGET/):
// valid inputs of every mode, dtype and layout, and the malformed cases the
// server must refuse by name. The committed corpus came from this program:
//   build/bin/plsh_fuzz_make_seeds tests/fuzz/corpus
// Files are named for what they hold; they stay small (a few KiB at most).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cli/npy.h"
#include "plsh/v1/plsh.pb.h"
#include "stream_framing.h"

namespace fs = std::filesystem;
using namespace plsh;
using namespace plsh::fuzz;

namespace {

fs::path g_root;

void write(const std::string& target, const std::string& name, const std::string& bytes) {
  const fs::path dir = g_root / target;
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
}

v1::AttendHeader header(v1::Mode mode, v1::DType dtype, int64_t n, int64_t heads, int64_t dim, bool causal) {
  v1::AttendHeader h;
  h.set_q_len(n);
  h.set_kv_len(n);
  h.set_heads(heads);
  h.set_head_dim(dim);
  h.set_dtype(dtype);
  h.set_mode(mode);
  h.set_causal(causal);
  if (mode == v1::MODE_LSH) h.set_samples(8);
  h.set_probe_rows(4);
  return h;
}

// 0.25 in each dtype's bit pattern, so that seeded streams compute.
std::string quarter(v1::DType d) {
  if (d == v1::DTYPE_F32) {
    const float f = 0.25f;
    return std::string(reinterpret_cast<const char*>(&f), 4);
  }
  return d == v1::DTYPE_F16 ? std::string("\x00\x34", 2) : std::string("\x80\x3e", 2);  // f16, bf16 0.25
}

std::string header_record(const v1::AttendHeader& h) { return record(RecordOp::kHeader, h.SerializeAsString()); }
std::string fit_chunk(int tensor, int64_t start, int64_t count, const std::string& fill) {
  return record(RecordOp::kChunk, chunk_payload(static_cast<uint8_t>(tensor | kFitRows), start, count, fill));
}
std::string end_record() { return record(RecordOp::kEnd, ""); }

// A whole valid stream: the header, q, k and v in `pieces` chunks each, the end.
std::string full_stream(const v1::AttendHeader& h, int pieces) {
  const int64_t b = h.batch() == 0 ? 1 : h.batch();
  const std::string fill = quarter(h.dtype());
  std::string s = header_record(h);
  const int64_t rows[3] = {b * h.q_len(), b * h.kv_len(), b * h.kv_len()};
  for (int t = 0; t < 3; ++t) {
    const int64_t step = (rows[t] + pieces - 1) / pieces;
    for (int64_t start = 0; start < rows[t]; start += step)
      s += fit_chunk(t + 1, start, std::min(step, rows[t] - start), fill);
  }
  return s + end_record();
}

// Calls f for every mode with every dtype: the mode's index m (0 exact, 1
// window, 2 lsh), causal on every other pair, and the seed name
// "ok_MODE_DTYPE".
template <class F>
void each_mode_and_dtype(F&& f) {
  const v1::DType dtypes[] = {v1::DTYPE_F32, v1::DTYPE_F16, v1::DTYPE_BF16};
  const v1::Mode modes[] = {v1::MODE_EXACT, v1::MODE_WINDOW, v1::MODE_LSH};
  const char* mode_names[] = {"exact", "window", "lsh"};
  const char* dtype_names[] = {"f32", "f16", "bf16"};
  for (int m = 0; m < 3; ++m)
    for (int d = 0; d < 3; ++d)
      f(modes[m], dtypes[d], m, (m + d) % 2 == 0, std::string("ok_") + mode_names[m] + "_" + dtype_names[d]);
}

void header_seeds() {
  each_mode_and_dtype([](v1::Mode mode, v1::DType dtype, int, bool causal, const std::string& name) {
    write("header", name, header(mode, dtype, 16, 2, 8, causal).SerializeAsString());
  });
  v1::AttendHeader h = header(v1::MODE_LSH, v1::DTYPE_F32, 33, 4, 8, true);
  h.set_batch(2);
  h.set_kv_heads(2);
  h.set_kv_len(40);
  h.set_q_pos0(7);
  h.set_k_pos0(0);
  h.add_slopes(0.5);
  h.add_slopes(0.25);
  h.add_slopes(0);
  h.add_slopes(1.0 / 1024);
  h.set_seed(42);
  h.set_lsh_algorithm(v1::LSH_ALGORITHM_BANDED);
  h.set_return_draws(true);
  h.set_return_lse(true);
  h.set_out_dtype(v1::DTYPE_F16);
  h.set_request_id("seed-gqa");
  h.set_out_chunk_bytes(100);
  h.set_scale(0.125);
  write("header", "ok_gqa_all_fields", h.SerializeAsString());
  v1::AttendHeader w = header(v1::MODE_WINDOW, v1::DTYPE_F32, 64, 1, 4, false);
  w.set_window_width(5);
  w.set_estimates(false);
  w.set_mask_row_budget(3);
  w.set_backend("cpu");
  write("header", "ok_window_width", w.SerializeAsString());

  auto bad = [&](const char* name, auto&& edit) {
    v1::AttendHeader b = header(v1::MODE_LSH, v1::DTYPE_F32, 16, 2, 8, true);
    edit(b);
    write("header", std::string("bad_") + name, b.SerializeAsString());
  };
  bad("kv_heads", [](v1::AttendHeader& b) { b.set_kv_heads(3); });
  bad("dtype_unset", [](v1::AttendHeader& b) { b.clear_dtype(); });
  bad("dtype_enum", [](v1::AttendHeader& b) { b.set_dtype(static_cast<v1::DType>(77)); });
  bad("samples_zero", [](v1::AttendHeader& b) { b.set_samples(0); });
  bad("samples_over_limit", [](v1::AttendHeader& b) { b.set_samples(5000); });
  bad("tokens_over_limit", [](v1::AttendHeader& b) {
    b.set_q_len(int64_t{1} << 21);
    b.set_kv_len(int64_t{1} << 21);
  });
  bad("head_dim", [](v1::AttendHeader& b) { b.set_head_dim(4096); });
  bad("slopes_count", [](v1::AttendHeader& b) { b.add_slopes(1); });
  bad("slopes_nan", [](v1::AttendHeader& b) {
    b.add_slopes(NAN);
    b.add_slopes(1);
  });
  bad("scale_inf", [](v1::AttendHeader& b) { b.set_scale(INFINITY); });
  bad("q_pos0_causal", [](v1::AttendHeader& b) { b.set_q_pos0(-5); });
  bad("request_id", [](v1::AttendHeader& b) { b.set_request_id(std::string(200, 'x')); });
  bad("request_id_binary", [](v1::AttendHeader& b) { b.set_request_id(std::string("a\x01b", 3)); });
  bad("backend", [](v1::AttendHeader& b) { b.set_backend("tpu"); });
  bad("out_chunk_bytes", [](v1::AttendHeader& b) { b.set_out_chunk_bytes(-1); });
  bad("heads_wide_row", [](v1::AttendHeader& b) {
    b.set_heads(1 << 20);
    b.set_head_dim(1024);
  });
  bad("probe_rows", [](v1::AttendHeader& b) { b.set_probe_rows(1 << 20); });
  bad("window_eps", [](v1::AttendHeader& b) {
    b.set_mode(v1::MODE_WINDOW);
    b.set_window_eps(1.5);
  });
}

void stream_seeds() {
  // 1, 2 or 3 chunks a tensor, by mode.
  each_mode_and_dtype([](v1::Mode mode, v1::DType dtype, int m, bool causal, const std::string& name) {
    write("stream", name, full_stream(header(mode, dtype, 8, 2, 4, causal), 1 + m));
  });
  v1::AttendHeader g = header(v1::MODE_LSH, v1::DTYPE_F32, 6, 4, 4, true);
  g.set_batch(2);
  g.set_kv_heads(2);
  g.set_kv_len(9);
  g.set_return_lse(true);
  g.set_lsh_algorithm(v1::LSH_ALGORITHM_PER_SAMPLE);
  write("stream", "ok_gqa_batch2", full_stream(g, 3));

  // A stream built by hand, with the chunks as raw protobuf messages.
  const v1::AttendHeader h = header(v1::MODE_EXACT, v1::DTYPE_F32, 4, 1, 2, true);
  std::string raw;
  {
    v1::AttendRequest r;
    *r.mutable_header() = h;
    raw += record(RecordOp::kRaw, r.SerializeAsString());
    for (int t = 1; t <= 3; ++t) {
      v1::AttendRequest c;
      c.mutable_chunk()->set_tensor(static_cast<v1::Tensor>(t));
      c.mutable_chunk()->set_row_start(0);
      c.mutable_chunk()->set_row_count(4);
      std::string data;
      for (int i = 0; i < 8; ++i) data += quarter(v1::DTYPE_F32);
      c.mutable_chunk()->set_data(data);
      raw += record(RecordOp::kRaw, c.SerializeAsString());
    }
    v1::AttendRequest e;
    e.mutable_end();
    raw += record(RecordOp::kRaw, e.SerializeAsString());
  }
  write("stream", "ok_raw_messages", raw);

  const std::string fill = quarter(v1::DTYPE_F32);
  const std::string head = header_record(h);
  write("stream", "bad_chunk_before_header", fit_chunk(1, 0, 4, fill) + head);
  write("stream", "bad_end_before_header", end_record() + head);
  write("stream", "bad_header_twice", head + head);
  write("stream", "bad_overlap", head + fit_chunk(1, 0, 3, fill) + fit_chunk(1, 2, 2, fill));
  write("stream", "bad_overlap_before", head + fit_chunk(2, 2, 2, fill) + fit_chunk(2, 0, 3, fill));
  write("stream", "bad_row_start", head + fit_chunk(3, 4, 1, fill));
  write("stream", "bad_row_start_negative", head + fit_chunk(3, -1, 1, fill));
  write("stream", "bad_row_count_overflow", head + fit_chunk(1, 1, INT64_MAX, fill));
  write("stream", "bad_tensor_out", head + fit_chunk(4, 0, 1, fill));
  write("stream", "bad_data_size", head + record(RecordOp::kChunk, chunk_payload(1, 0, 2, std::string(15, 'a'))));
  write("stream", "bad_missing_rows",
        head + fit_chunk(1, 0, 4, fill) + fit_chunk(2, 0, 4, fill) + fit_chunk(3, 0, 3, fill) + end_record());
  write("stream", "bad_nan_input",
        head + fit_chunk(1, 0, 4, std::string("\x00\x00\xc0\x7f", 4)) + fit_chunk(2, 0, 4, fill) +
            fit_chunk(3, 0, 4, fill) + end_record());
  write("stream", "bad_empty_kind", head + record(RecordOp::kRaw, ""));
  v1::AttendHeader big = h;
  big.set_q_len(64);
  big.set_kv_len(64);
  big.set_heads(1);
  big.set_head_dim(256);
  write("stream", "bad_oversize_message", header_record(big) + fit_chunk(1, 0, 64, fill));
}

std::vector<int64_t> shape(std::initializer_list<int64_t> d) { return d; }

void npy_seeds() {
  const float f[6] = {1, 2, 3, 4, 5, 6};
  write("npy", "ok_f32_2x3", cli::npy_bytes(DType::kF32, shape({2, 3}), f));
  const uint16_t h[16] = {0x3c00, 0x4000, 0x3400, 0};
  write("npy", "ok_f16_1x2x2x4", cli::npy_bytes(DType::kF16, shape({1, 2, 2, 4}), h));
  write("npy", "ok_bf16_3", cli::npy_bytes(DType::kBF16, shape({3}), h));
  write("npy", "ok_scalar", cli::npy_bytes(DType::kF32, shape({}), f));
  write("npy", "ok_zero_dim", cli::npy_bytes(DType::kF32, shape({0, 5}), f));
  auto with_dict = [](int major, const std::string& dict, const std::string& data) {
    std::string out("\x93NUMPY", 6);
    out += static_cast<char>(major);
    out += '\0';
    const size_t len = dict.size();
    for (int i = 0; i < (major == 1 ? 2 : 4); ++i) out += static_cast<char>((len >> (8 * i)) & 0xff);
    return out + dict + data;
  };
  const std::string eight(reinterpret_cast<const char*>(f), 8);
  write("npy", "ok_v2", with_dict(2, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }\n", eight));
  write("npy", "ok_v3_long", with_dict(3, "{\"shape\": (2L,), \"fortran_order\": False, \"descr\": \"<f4\"}", eight));
  write("npy", "bad_fortran", with_dict(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2,), }", eight));
  write("npy", "bad_big_endian", with_dict(1, "{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", eight));
  write("npy", "bad_structured",
        with_dict(1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", eight));
  write("npy", "bad_truncated", with_dict(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", eight));
  write("npy", "bad_trailing", with_dict(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", eight));
  write("npy", "bad_huge_shape",
        with_dict(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1048576, 1048576, 1048576), }", ""));
  write("npy", "bad_header_len", std::string("\x93NUMPY\x01\x00\xff\xff{", 11));
  write("npy", "bad_version", std::string("\x93NUMPY\x04\x00\x00\x00", 10));
}

void http_seeds() {
  write("metrics_http", "get_metrics", "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
  write("metrics_http", "head_metrics_10", "HEAD /metrics HTTP/1.0\r\n\r\n");
  write("metrics_http", "get_root", "GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  write("metrics_http", "post_body", "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello");
  write("metrics_http", "chunked",
        "PUT /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
  write("metrics_http", "pipelined",
        "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  write("metrics_http", "absolute_uri", "GET http://127.0.0.1/metrics?x=1#f HTTP/1.1\r\nHost: x\r\n\r\n");
  write("metrics_http", "options_star", "OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n");
  write("metrics_http", "long_header",
        "GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: " + std::string(4000, 'a') + "\r\n\r\n");
  write("metrics_http", "folded_header", "GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: a\r\n  b\r\n\r\n");
  write("metrics_http", "no_version", "GET /metrics\r\n\r\n");
  write("metrics_http", "bare_lf", "GET /metrics HTTP/1.1\nHost: x\n\n");
  write("metrics_http", "binary", std::string("\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", 11));  // a TLS hello
  write("metrics_http", "expect_continue",
        "POST /metrics HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 1000\r\n\r\n");
  write("metrics_http", "percent_path", "GET /%6detrics%00 HTTP/1.1\r\nHost: x\r\n\r\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  g_root = argv[1];
  header_seeds();
  stream_seeds();
  npy_seeds();
  http_seeds();
  return 0;
}
