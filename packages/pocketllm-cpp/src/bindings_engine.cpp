// pocketllm_cpp._native.Engine and the typed structs that cross its boundary: a request's SamplingConfig in, each
// step's Deltas (with their Finish and TokenLogprobs) out, EngineStats and Profile.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "pocketllm_cpp/engine.h"

namespace nb = nanobind;
using namespace pocketllm;

namespace {

using Mask = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// An engine and the model it runs (whose Python object keeps the weights' arrays alive).
struct PyEngine {
    nb::object model_owner;  // the models' tensors' owners: destroyed after the engine that reads them
    nb::object draft_owner;
    std::unique_ptr<Engine> engine;
};

void bind_sampling(nb::module_& m) {
    nb::class_<SamplingConfig>(m, "SamplingConfig", "How one request samples (the core has resolved and checked it).")
        .def(nb::init<>())
        .def_rw("max_tokens", &SamplingConfig::max_tokens)
        .def_rw("min_tokens", &SamplingConfig::min_tokens)
        .def_rw("temperature", &SamplingConfig::temperature)
        .def_rw("top_p", &SamplingConfig::top_p)
        .def_rw("top_k", &SamplingConfig::top_k, "0: off")
        .def_rw("min_p", &SamplingConfig::min_p)
        .def_rw("presence_penalty", &SamplingConfig::presence_penalty)
        .def_rw("frequency_penalty", &SamplingConfig::frequency_penalty)
        .def_rw("repetition_penalty", &SamplingConfig::repetition_penalty)
        .def_rw("seed", &SamplingConfig::seed, nb::arg().none(), "None: the engine's next seed")
        .def_rw("stop_ids", &SamplingConfig::stop_ids, "EOS (unless ignored) and the request's stop token ids")
        .def_rw("request_stop_ids", &SamplingConfig::request_stop_ids, "the request's own (reported as stop_token_id)")
        .def_rw("logit_bias", &SamplingConfig::logit_bias)
        .def_rw("logprobs", &SamplingConfig::logprobs, "-1: none; else how many top alternatives")
        .def_rw("prompt_logprobs", &SamplingConfig::prompt_logprobs,
                "-1: none; else the prompt is scored, with this many top alternatives (no cached prefix is reused)");
    nb::class_<Alternative>(m, "Alternative", "One of the most likely tokens at a position.")
        .def_ro("token", &Alternative::token)
        .def_ro("logprob", &Alternative::logprob);
    nb::class_<TokenLogprobs>(m, "TokenLogprobs", "A sampled token's logprob and rank, and the top alternatives.")
        .def_ro("token", &TokenLogprobs::token)
        .def_ro("logprob", &TokenLogprobs::logprob)
        .def_ro("rank", &TokenLogprobs::rank, "1: the most likely token")
        .def_ro("top", &TokenLogprobs::top);
}

void bind_outputs(nb::module_& m) {
    nb::enum_<Finish>(m, "Finish", "How a request finished in a step, if it did.")
        .value("none", Finish::None)
        .value("stop", Finish::Stop)
        .value("length", Finish::Length)
        .value("error", Finish::Error, "nothing could be sampled (the allowed tokens left none)");
    nb::class_<SpeculativeConfig>(m, "SpeculativeConfig", "Speculative decoding's settings (ngram or MTP drafts).")
        .def(nb::init<>())
        .def_rw("num_tokens", &SpeculativeConfig::num_tokens, "most drafted per sequence and step; 0: off")
        .def_rw("ngram_min", &SpeculativeConfig::ngram_min)
        .def_rw("ngram_max", &SpeculativeConfig::ngram_max)
        .def_rw("max_batch", &SpeculativeConfig::max_batch, "nobody drafts while more sequences than this run")
        .def_rw("mtp", &SpeculativeConfig::mtp, "drafts from the model's multi-token-prediction head")
        .def_rw("draft_model", &SpeculativeConfig::draft_model, "drafts from the engine's draft model");
    nb::class_<Delta>(m, "Delta", "What one step did for one request.")
        .def_ro("request_id", &Delta::request_id)
        .def_ro("tokens", &Delta::tokens, "its new tokens")
        .def_ro("finish", &Delta::finish)
        .def_prop_ro("stop_token_id",
                     [](const Delta& d) { return d.stop_token_id < 0 ? std::nullopt : std::optional<int32_t>(d.stop_token_id); },
                     "the requested stop token that ended it, if one did")
        .def_ro("logprobs", &Delta::logprobs, "one per new token, where the request asked for them")
        .def_ro("prompt_logprobs", &Delta::prompt_logprobs,
                "prompt tokens 1 .. P-1 each given those before it, on the first delta with a token, where asked for")
        .def_prop_ro("embedding",
                     [](const Delta& d) { return d.embedding.empty() ? std::nullopt : std::optional(d.embedding); },
                     "an embedding request's result");
    nb::class_<EngineStats>(m, "EngineStats", "The engine's counters now (stats()).")
        .def_ro("running", &EngineStats::running)
        .def_ro("waiting", &EngineStats::waiting)
        .def_ro("blocks_total", &EngineStats::blocks_total)
        .def_ro("blocks_used", &EngineStats::blocks_used)
        .def_ro("preemptions", &EngineStats::preemptions)
        .def_ro("prefix_queries", &EngineStats::prefix_queries, "prompt tokens looked up in the prefix cache")
        .def_ro("prefix_hits", &EngineStats::prefix_hits, "of them, tokens found")
        .def_ro("state_snapshots", &EngineStats::state_snapshots, "state snapshots held (hybrid models)")
        .def_ro("state_snapshot_hits", &EngineStats::state_snapshot_hits, "requests resumed from one")
        .def_ro("state_snapshot_evictions", &EngineStats::state_snapshot_evictions)
        .def_ro("speculative", &EngineStats::speculative);
    nb::class_<SpeculativeStats>(m, "SpeculativeStats", "Speculative decoding's counters, cumulative.")
        .def_ro("drafts", &SpeculativeStats::drafts, "a sequence drafting in a step")
        .def_ro("draft_tokens", &SpeculativeStats::draft_tokens)
        .def_ro("accepted_tokens", &SpeculativeStats::accepted_tokens)
        .def_ro("accepted_per_position", &SpeculativeStats::accepted_per_position,
                "index i: drafts whose token i was accepted");
    nb::class_<Profile>(m, "Profile", "Seconds per phase of the steps since reset_profile(), and their counts.")
        .def_ro("step", &Profile::step)
        .def_ro("schedule", &Profile::schedule)
        .def_ro("forward", &Profile::forward)
        .def_ro("matmul", &Profile::matmul)
        .def_ro("lm_head", &Profile::lm_head)
        .def_ro("attention", &Profile::attention)
        .def_ro("recurrence", &Profile::recurrence)
        .def_ro("wait", &Profile::wait)
        .def_ro("sample", &Profile::sample)
        .def_ro("steps", &Profile::steps)
        .def_ro("tokens", &Profile::tokens)
        .def_ro("regions", &Profile::regions);
}

}  // namespace

void pocketllm::bind_engine(nb::module_& m) {
    bind_sampling(m);
    bind_outputs(m);
    nb::class_<PyEngine>(m, "Engine", "Scheduler, KV block pool, state slots and sampler over a Model; one thread calls it.")
        .def(
            "__init__",
            [](PyEngine* self, nb::object model, int64_t max_num_seqs, int64_t max_num_batched_tokens,
               int64_t prefill_chunk_size, int64_t seed, bool prefix_caching, int64_t snapshot_bytes,
               const SpeculativeConfig& speculative, nb::object draft) {
                if (!nb::isinstance<PyModel>(model)) throw nb::type_error("model must be a pocketllm_cpp._native.Model");
                if (!draft.is_none() && !nb::isinstance<PyModel>(draft)) {
                    throw nb::type_error("draft must be a pocketllm_cpp._native.Model or None");
                }
                PyModel& owner = nb::cast<PyModel&>(model);
                std::shared_ptr<Model> drafting = draft.is_none() ? nullptr : nb::cast<PyModel&>(draft).model;
                new (self) PyEngine{model, draft, std::make_unique<Engine>(
                    owner.model, SchedulerConfig{max_num_seqs, max_num_batched_tokens, prefill_chunk_size,
                                                 static_cast<uint64_t>(seed), prefix_caching, snapshot_bytes},
                    speculative, std::move(drafting))};
            },
            nb::arg("model"), nb::arg("max_num_seqs"), nb::arg("max_num_batched_tokens"),
            nb::arg("prefill_chunk_size"), nb::arg("seed"), nb::arg("prefix_caching") = false, nb::arg("snapshot_bytes") = 0,
            nb::arg("speculative") = SpeculativeConfig{}, nb::arg("draft").none() = nb::none())
        .def(
            "add_request",
            [](PyEngine& self, const std::string& id, std::vector<int32_t> prompt, const SamplingConfig& sampling,
               bool drafts) { self.engine->add_request(id, std::move(prompt), sampling, drafts); },
            nb::arg("request_id"), nb::arg("prompt"), nb::arg("sampling"), nb::arg("drafts") = true,
            "drafts: whether speculative decoding may draft for it (not for a grammar's)")
        .def(
            "add_embedding_request",
            [](PyEngine& self, const std::string& id, std::vector<int32_t> prompt, Pooling pool, bool normalize) {
                if (pool == Pooling::None) throw std::invalid_argument("an embedding request needs a pooling");
                self.engine->add_embedding_request(id, std::move(prompt), pool, normalize);
            },
            nb::arg("request_id"), nb::arg("prompt"), nb::arg("pooling"), nb::arg("normalize"))
        .def(
            "step",
            [](PyEngine& self) {
                nb::gil_scoped_release released;
                return self.engine->step();
            },
            "One scheduling step: a Delta per request it advanced.")
        .def(
            "set_allowed",
            [](PyEngine& self, const std::string& id, const Mask& words) {
                self.engine->set_allowed(id, std::vector<uint32_t>(words.data(), words.data() + words.size()));
            },
            nb::arg("request_id"), nb::arg("words"),
            "The tokens a request may sample next: a bitmask of (vocab + 31) // 32 uint32 words (empty: any).")
        .def("abort", [](PyEngine& self, const std::vector<std::string>& ids) { self.engine->abort(ids); })
        .def("has_unfinished", [](PyEngine& self) { return self.engine->has_unfinished(); })
        .def("profile", [](PyEngine& self) { return self.engine->profile(); })
        .def("reset_profile", [](PyEngine& self) { self.engine->reset_profile(); })
        .def("stats", [](PyEngine& self) { return self.engine->stats(); });
}
