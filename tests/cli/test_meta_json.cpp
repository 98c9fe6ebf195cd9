// The metadata JSON: legal JSON for every value (no inf/nan literals),
// uint64 seeds and doubles that read back exactly.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include <nlohmann/json.hpp>

#include "cli/meta_json.h"
#include "shaped.h"

namespace plsh::cli {
namespace {

using plsh::testing::shaped;

TEST(MetaJson, NonFiniteValuesAreNullAndEverythingRoundTrips) {
  AttentionResult r;
  r.backend = "cpu";
  r.device = "test";
  r.mode = Mode::kLsh;
  r.lsh_algorithm = LshAlgorithm::kBanded;
  r.samples = 3;
  r.seed = std::numeric_limits<uint64_t>::max();
  r.flops = 1.0 / 3.0;
  r.dense_flops = 12345678901234567.0;
  r.timings["compute"] = 0.1;
  HeadEstimate finite;
  finite.head = 0;
  finite.slope = 0.0625;
  finite.sigma = 16;
  finite.max_block = 40;
  finite.mask_max_err = 0.1 + 0.2;  // not representable in a short decimal
  finite.probe.rows = 64;
  finite.probe.bound_max = std::numeric_limits<double>::infinity();
  finite.draws = {{17.25, 3.0000000000000004}, {1e-300, 5e-324}};
  HeadEstimate flat;  // slope 0: sigma = +inf, one block spanning everything
  flat.head = 1;
  flat.slope = 0;
  flat.sigma = std::numeric_limits<double>::infinity();
  flat.window = kNoWindow;
  flat.draws = {{std::numeric_limits<double>::infinity(), 0.0}};
  r.heads = {finite, flat};

  const std::string text = result_to_json(r).dump(2);
  EXPECT_EQ(text.find("inf"), std::string::npos) << text;
  EXPECT_EQ(text.find("nan"), std::string::npos) << text;
  const nlohmann::json j = nlohmann::json::parse(text);  // throws on anything illegal

  EXPECT_EQ(j["seed"].get<uint64_t>(), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(j["mode"], "lsh");
  EXPECT_EQ(j["lsh_algorithm"], "banded");
  EXPECT_EQ(j["flops"].get<double>(), 1.0 / 3.0);
  EXPECT_EQ(j["dense_flops"].get<double>(), 12345678901234567.0);
  const auto& h0 = j["heads"][0];
  EXPECT_EQ(h0["mask_max_err"].get<double>(), 0.1 + 0.2);
  EXPECT_TRUE(h0["probe"]["bound_max"].is_null());
  EXPECT_EQ(h0["draws"][0][1].get<double>(), 3.0000000000000004);
  EXPECT_EQ(h0["draws"][1][0].get<double>(), 1e-300);
  EXPECT_EQ(h0["draws"][1][1].get<double>(), 5e-324);
  const auto& h1 = j["heads"][1];
  EXPECT_TRUE(h1["sigma"].is_null());
  EXPECT_TRUE(h1["window"].is_null());
  EXPECT_TRUE(h1["draws"][0][0].is_null());
  EXPECT_EQ(h1["slope"].get<double>(), 0.0);
}

TEST(MetaJson, DrawsOnlyWhenPresent) {
  AttentionResult r;
  r.heads.resize(1);
  const nlohmann::json j = nlohmann::json::parse(result_to_json(r).dump());
  EXPECT_FALSE(j["heads"][0].contains("draws"));
  EXPECT_TRUE(j["heads"][0].contains("probe"));
  EXPECT_TRUE(j["summary"]["probe"].contains("rel_err_stderr"));
}

// "shape" and "params": what was asked for from the options (kv_heads = 0
// and an unset out_dtype resolved by the library's rules), the resolved
// defaults from the result, never re-derived here.
TEST(MetaJson, ParamsTakeResolvedDefaultsFromTheResult) {
  const AttentionOptions o = shaped({2, 5, 9, 4, 0, 16}, {.dtype = DType::kF16, .causal = true});
  AttentionResult r;
  r.scale = 0.375;  // not 1/sqrt(16): the result's word is taken as is
  r.q_pos0 = 104;
  r.k_pos0 = 100;
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  add_params_json(o, r, false, &meta);
  const nlohmann::json j = nlohmann::json::parse(meta.dump());
  EXPECT_EQ(j["shape"], nlohmann::json::parse(R"({"batch": 2, "q_len": 5, "kv_len": 9, "heads": 4, "kv_heads": 4,
      "head_dim": 16, "dtype": "f16", "out_dtype": "f16", "batched": false})"));
  EXPECT_EQ(j["params"]["scale"].get<double>(), 0.375);
  EXPECT_EQ(j["params"]["q_pos0"], 104);
  EXPECT_EQ(j["params"]["k_pos0"], 100);
  EXPECT_EQ(j["params"]["causal"], true);
  EXPECT_EQ(j["params"]["window_eps"].get<double>(), kDefaultWindowEps);
  EXPECT_EQ(j["params"]["probe_rows"], kDefaultProbeRows);
  EXPECT_EQ(j["params"]["mask_row_budget"], kDefaultMaskRowBudget);
  EXPECT_EQ(j["params"]["estimates"], true);
}

}  // namespace
}  // namespace plsh::cli
