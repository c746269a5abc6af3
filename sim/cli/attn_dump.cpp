// pdsim attn-dump: one random paged-attention case, run through a backend, written as .npy files
// (layout: docs/design.md "attn-dump") so any backend can be cross-checked against NumPy or
// PyTorch.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "backends/attention/attention_backend.h"
#include "backends/kv/kv_pool.h"
#include "backends/runtime/cpu_stream.h"
#include "common/npy.h"
#include "sim/cli/cli_util.h"
#include "sim/cli/command.h"

namespace pdsim::cli {

namespace {

constexpr int64_t kMaxDumpKvBytes = int64_t{4} << 30;  // the case's KV cache

struct AttnDumpOptions {
    std::string out_dir;
    uint64_t seed = 1;
    std::string mode = "extend";
    std::string dtype = "fp32";
    std::string backend = "cpu";
    int batch = 3;
    int q_heads = 8;
    int kv_heads = 2;
    int head_dim = 64;
    int page_size = 16;
    int max_seq_len = 300;
};

// One random case: the requests' lengths, the pool with their pages scattered and their cached
// prefixes written, and the new tokens' q, k, v and KV slots.
struct DumpCase {
    int bs = 0;
    std::vector<int32_t> seq_lens, q_lens;
    int max_pages = 0;    // page table stride
    int total_pages = 0;  // pages in the pool
    std::vector<int32_t> page_table;
    std::unique_ptr<kv::MHATokenToKVPool> pool;
    int num_tokens = 0;
    std::vector<float> q, k, v;
    std::vector<int32_t> locs;
};

void draw_lengths(const AttnDumpOptions& o, attn::ForwardMode mode, std::mt19937_64& rng,
                  DumpCase* c) {
    const int bs = o.batch;
    c->bs = bs;
    c->seq_lens.resize(static_cast<size_t>(bs));
    c->q_lens.resize(static_cast<size_t>(bs));
    for (size_t i = 0; i < static_cast<size_t>(bs); ++i) {
        c->seq_lens[i] = std::uniform_int_distribution<int>(1, o.max_seq_len)(rng);
        c->q_lens[i] = mode == attn::ForwardMode::kDecode
                           ? 1
                           : std::uniform_int_distribution<int>(1, c->seq_lens[i])(rng);
    }
    c->max_pages = (o.max_seq_len + o.page_size - 1) / o.page_size;
    c->total_pages = 1;
    for (int s : c->seq_lens) c->total_pages += (s + o.page_size - 1) / o.page_size;
    c->total_pages += 3;  // a few pages no request uses
}

// The pool, zeroed, with each request scattered over a shuffled set of pages (non-contiguous
// page tables) and its cached prefix written directly into the pool.
Status fill_pool(const AttnDumpOptions& o, kv::KVDtype dtype, std::mt19937_64& rng,
                 std::normal_distribution<float>& nd, DumpCase* c) {
    kv::MHAPoolConfig pc;
    pc.num_layers = 1;
    pc.num_pages = c->total_pages;
    pc.page_size = o.page_size;
    pc.num_kv_heads = o.kv_heads;
    pc.head_dim = o.head_dim;
    pc.dtype = dtype;
    PDSIM_ASSIGN_OR_RETURN(c->pool, kv::MHATokenToKVPool::create(pc));
    PDSIM_RETURN_IF_ERROR(c->pool->fill(0));
    PDSIM_ASSIGN_OR_RETURN(std::vector<int32_t> pages,
                           c->pool->allocator().alloc(c->pool->allocator().available()));
    std::shuffle(pages.begin(), pages.end(), rng);
    const auto stride = static_cast<size_t>(c->max_pages);
    c->page_table.assign(static_cast<size_t>(c->bs) * stride, 0);
    size_t next = 0;
    for (size_t i = 0; i < static_cast<size_t>(c->bs); ++i) {
        const int n = (c->seq_lens[i] + o.page_size - 1) / o.page_size;
        for (int p = 0; p < n; ++p)
            c->page_table[i * stride + static_cast<size_t>(p)] = pages[next++];
    }
    std::vector<float> tok(static_cast<size_t>(o.kv_heads) * static_cast<size_t>(o.head_dim));
    for (size_t i = 0; i < static_cast<size_t>(c->bs); ++i) {
        for (int t = 0; t < c->seq_lens[i] - c->q_lens[i]; ++t) {
            const int64_t slot =
                static_cast<int64_t>(
                    c->page_table[i * stride + static_cast<size_t>(t / o.page_size)]) *
                    o.page_size +
                t % o.page_size;
            for (int b = 0; b < 2; ++b) {
                for (auto& x : tok) x = nd(rng);
                c->pool->write_token(0, b, slot, tok.data());
            }
        }
    }
    return {};
}

// New tokens (written by the backend: save_kv_cache = true): q, k, v and their KV slots.
void draw_new_tokens(const AttnDumpOptions& o, std::mt19937_64& rng,
                     std::normal_distribution<float>& nd, DumpCase* c) {
    const size_t kvw = static_cast<size_t>(o.kv_heads) * static_cast<size_t>(o.head_dim);
    c->num_tokens = std::accumulate(c->q_lens.begin(), c->q_lens.end(), 0);
    c->q.resize(static_cast<size_t>(c->num_tokens) * static_cast<size_t>(o.q_heads * o.head_dim));
    c->k.resize(static_cast<size_t>(c->num_tokens) * kvw);
    c->v.resize(c->k.size());
    for (auto* vec : {&c->q, &c->k, &c->v})
        for (auto& x : *vec) x = nd(rng);
    const auto stride = static_cast<size_t>(c->max_pages);
    for (size_t i = 0; i < static_cast<size_t>(c->bs); ++i) {
        for (int j = 0; j < c->q_lens[i]; ++j) {
            const int t = c->seq_lens[i] - c->q_lens[i] + j;
            c->locs.push_back(c->page_table[i * stride + static_cast<size_t>(t / o.page_size)] *
                                  o.page_size +
                              t % o.page_size);
        }
    }
}

// Runs the case's layer through --backend; `out` gets the attention output.
Status run_backend(const AttnDumpOptions& o, kv::KVDtype dtype, attn::ForwardMode mode,
                   const attn::LayerSpec& layer, DumpCase& c, std::vector<float>* out) {
    out->assign(c.q.size(), std::numeric_limits<float>::quiet_NaN());
    runtime::CpuStream stream("attn-dump");
    attn::AttentionConfig ac;
    ac.num_q_heads = o.q_heads;
    ac.num_kv_heads = o.kv_heads;
    ac.head_dim = o.head_dim;
    ac.kv_dtype = dtype;
    ac.stream = &stream;
    PDSIM_ASSIGN_OR_RETURN(auto backend, attn::create_attention_backend(o.backend, ac));
    attn::ForwardBatch fb;
    fb.mode = mode;
    fb.bs = c.bs;
    fb.seq_lens = c.seq_lens;
    fb.extend_lens = c.q_lens;
    fb.page_table = c.page_table;
    fb.page_table_stride = c.max_pages;
    PDSIM_RETURN_IF_ERROR(backend->init_forward_metadata(fb));
    const int64_t n = c.num_tokens;
    PDSIM_RETURN_IF_ERROR(backend->forward(
        runtime::host_view(static_cast<const float*>(c.q.data()), {n, o.q_heads, o.head_dim}),
        runtime::host_view(static_cast<const float*>(c.k.data()), {n, o.kv_heads, o.head_dim}),
        runtime::host_view(static_cast<const float*>(c.v.data()), {n, o.kv_heads, o.head_dim}),
        layer, runtime::host_view(static_cast<const int32_t*>(c.locs.data()), {n}), *c.pool, mode,
        c.bs, runtime::host_view(out->data(), {n, o.q_heads, o.head_dim})));
    return stream.synchronize();
}

Status write_dump(const AttnDumpOptions& o, kv::KVDtype dtype, const attn::LayerSpec& layer,
                  const DumpCase& c, const std::vector<float>& out) {
    std::error_code ec;
    std::filesystem::create_directories(o.out_dir, ec);
    if (ec) return Status(StatusCode::kInvalidArgument, "--out " + o.out_dir + ": " + ec.message());
    auto path = [&](const char* f) { return (std::filesystem::path(o.out_dir) / f).string(); };
    const int64_t T = c.num_tokens, H = o.q_heads, D = o.head_dim;
    const int bs = c.bs;
    PDSIM_RETURN_IF_ERROR(write_npy(path("q.npy"), "<f4", {T, H, D}, c.q.data(), c.q.size() * 4));
    PDSIM_RETURN_IF_ERROR(write_npy(path("out.npy"), "<f4", {T, H, D}, out.data(), out.size() * 4));
    const std::vector<int64_t> cache_shape{c.total_pages, o.page_size, o.kv_heads, o.head_dim};
    const size_t cache_bytes = c.pool->page_bytes(0, 0) * static_cast<size_t>(c.total_pages);
    const std::string cdescr = dtype == kv::KVDtype::kF32 ? "<f4" : "<u2";
    PDSIM_RETURN_IF_ERROR(
        write_npy(path("k_cache.npy"), cdescr, cache_shape, c.pool->data(0, 0), cache_bytes));
    PDSIM_RETURN_IF_ERROR(
        write_npy(path("v_cache.npy"), cdescr, cache_shape, c.pool->data(0, 1), cache_bytes));
    PDSIM_RETURN_IF_ERROR(write_npy(path("page_table.npy"), "<i4", {bs, c.max_pages},
                                    c.page_table.data(), c.page_table.size() * 4));
    PDSIM_RETURN_IF_ERROR(
        write_npy(path("seq_lens.npy"), "<i4", {bs}, c.seq_lens.data(), c.seq_lens.size() * 4));
    PDSIM_RETURN_IF_ERROR(
        write_npy(path("q_lens.npy"), "<i4", {bs}, c.q_lens.data(), c.q_lens.size() * 4));
    nlohmann::json meta = {{"mode", o.mode},
                           {"dtype", o.dtype},
                           {"backend", o.backend},
                           {"scale", attn::layer_scaling(layer)},
                           {"num_q_heads", o.q_heads},
                           {"num_kv_heads", o.kv_heads},
                           {"head_dim", o.head_dim},
                           {"page_size", o.page_size},
                           {"seed", o.seed}};
    return write_json_file("--out", path("meta.json"), meta);
}

Status run_attn_dump(const AttnDumpOptions& o) {
    PDSIM_RETURN_IF_ERROR(check_kv_bytes("--batch x --max-seq-len x --kv-heads x --head-dim",
                                         o.batch, o.max_seq_len + o.page_size, o.kv_heads,
                                         o.head_dim, kMaxDumpKvBytes));
    PDSIM_ASSIGN_OR_RETURN(kv::KVDtype dtype, kv::parse_dtype(o.dtype));
    PDSIM_ASSIGN_OR_RETURN(attn::ForwardMode mode, attn::parse_forward_mode(o.mode));
    if (mode != attn::ForwardMode::kExtend && mode != attn::ForwardMode::kDecode) {
        return Status(StatusCode::kInvalidArgument,
                      "--mode: expected decode or extend, got " + o.mode);
    }
    if (o.q_heads % o.kv_heads != 0) {
        return Status(
            StatusCode::kInvalidArgument,
            fmt::format("--q-heads {} is not a multiple of --kv-heads {}", o.q_heads, o.kv_heads));
    }
    std::mt19937_64 rng(o.seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    DumpCase c;
    draw_lengths(o, mode, rng, &c);
    PDSIM_RETURN_IF_ERROR(fill_pool(o, dtype, rng, nd, &c));
    draw_new_tokens(o, rng, nd, &c);
    const attn::LayerSpec layer{0, o.q_heads, o.kv_heads, o.head_dim, 0, 0.f};
    std::vector<float> out;
    PDSIM_RETURN_IF_ERROR(run_backend(o, dtype, mode, layer, c, &out));
    PDSIM_RETURN_IF_ERROR(write_dump(o, dtype, layer, c, out));
    std::printf("attn-dump: %s case, %d requests, %d query tokens, backend %s, dtype %s -> %s\n",
                o.mode.c_str(), c.bs, c.num_tokens, o.backend.c_str(), o.dtype.c_str(),
                o.out_dir.c_str());
    return {};
}

}  // namespace

void add_attn_dump_command(CLI::App& app, CommandSet& commands) {
    auto opts = std::make_shared<AttnDumpOptions>();
    CLI::App* sub = app.add_subcommand(
        "attn-dump",
        "Write one random paged-attention case, run through a backend, as NumPy .npy files:\n"
        "q, out [tokens, q_heads, head_dim]; k_cache, v_cache [pages, page_size, kv_heads, "
        "head_dim]\n"
        "(float32, or uint16 bf16 bits); page_table [batch, max_pages]; seq_lens, q_lens [batch];\n"
        "meta.json. Query tokens of sequence i are its last q_lens[i] positions and attend "
        "causally;\n"
        "query head h reads KV head h / (q_heads / kv_heads).");
    sub->add_option("--out", opts->out_dir, "Output directory (created)")
        ->required()
        ->check(non_empty());
    sub->add_option("--seed", opts->seed, "Random seed")->capture_default_str();
    sub->add_option("--mode", opts->mode, "decode or extend")
        ->check(CLI::IsMember({"decode", "extend"}))
        ->capture_default_str();
    sub->add_option("--dtype", opts->dtype, "KV cache dtype: fp32 or bf16")
        ->check(CLI::IsMember({"fp32", "bf16"}))
        ->capture_default_str();
    sub->add_option("--backend", opts->backend, "Attention backend (cpu, cpu_ref, ...)")
        ->check(non_empty())
        ->capture_default_str();
    sub->add_option("--batch", opts->batch, "Number of sequences")
        ->check(CLI::Range(1, 256))
        ->capture_default_str();
    sub->add_option("--q-heads", opts->q_heads, "Query heads")
        ->check(CLI::Range(1, 256))
        ->capture_default_str();
    sub->add_option("--kv-heads", opts->kv_heads, "KV heads")
        ->check(CLI::Range(1, 256))
        ->capture_default_str();
    sub->add_option("--head-dim", opts->head_dim, "Head dimension")
        ->check(CLI::Range(1, 1024))
        ->capture_default_str();
    sub->add_option("--page-size", opts->page_size, "Tokens per KV page")
        ->check(CLI::Range(1, 1024))
        ->capture_default_str();
    sub->add_option("--max-seq-len", opts->max_seq_len, "Longest KV length drawn")
        ->check(CLI::Range(1, 65536))
        ->capture_default_str();
    commands.add(sub, [opts] { return run_attn_dump(*opts); });
}

}  // namespace pdsim::cli
