// InfiniGen's layer-capped selection in blocks of slots (budget "layer", `infinigen_select.choose_blocks`) of one
// decoding row per batch row, from its speculated scores to the chosen slots and the packed rows the attention
// reads, in one call: what some hundred torch calls make per layer (the scores' softmax per query head, the
// block masses, the top blocks under the cap, the mask and `KVStore.select_rows`'s packing).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "native_common.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>
#include <limits>
#include <utility>
#include <vector>

namespace {

using infinigen_native::exp_nonpositive;
using infinigen_native::packed_starts;
using infinigen_native::exp_relative;
using infinigen_native::scaled_max;
using infinigen_native::unread_lse;


struct Block {  // one (KV head, block) of a batch row
  float mass;   // the block's speculated mass; -1 where no token of it qualifies
  int64_t index;  // KV head * blocks + block
};

// The cut's order (`top_n_per_row`): more mass first; equal mass, the lower (KV head, block) first.
inline bool before(const Block& a, const Block& b) {
  return a.mass > b.mass || (a.mass == b.mass && a.index < b.index);
}

// The kept slots keep [B, Hkv, n] (their counts per (batch row, KV head) given) packed as `KVStore.select_rows`
// packs them: rows [B, m] of the flat [B * Hkv * capacity, d] store, head-major in ascending slots, padded with
// row 0 to the longest batch row's m, and head [B, m] (-1 on padding).
std::pair<torch::Tensor, torch::Tensor> pack_kept(const bool* keep_p, const int64_t* counts_p, int64_t b,
                                                  int64_t hkv, int64_t n, int64_t capacity,
                                                  const torch::TensorOptions& opts) {
  std::vector<int64_t> starts;
  const int64_t m = packed_starts(counts_p, b, hkv, starts);
  auto rows = torch::zeros({b, m}, opts.dtype(torch::kLong));
  auto head = torch::full({b, m}, -1, opts.dtype(torch::kLong));
  int64_t* rows_p = rows.data_ptr<int64_t>();
  int64_t* head_p = head.data_ptr<int64_t>();
  at::parallel_for(0, b * hkv, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t bi = bh / hkv, kh = bh % hkv;
      const bool* kp = keep_p + bh * n;
      int64_t* out = rows_p + bi * m + starts[bh];
      int64_t c = 0;
      for (int64_t j = 0; j < n; ++j)
        if (kp[j]) out[c++] = bh * capacity + j;
      std::fill(head_p + bi * m + starts[bh], head_p + bi * m + starts[bh] + c, kh);
    }
  });
  return {rows, head};
}

}  // namespace

// scores [B, Hkv, G, n] float32 (every slot of the store's first n valid: no padding, no window; OVERWRITTEN with
// exp(relative)). Per query head relative = s * scale - max (the max clamped to float32's lowest); a slot
// qualifies when its group's largest relative exceeds -alpha; blocks are `block` consecutive slots (the last one
// shorter, `block` above n: one block of n), a block qualifies when one of its slots does, and its mass is the
// sum over its slots of the group's summed weights exp(relative) / the head's sum. A batch row whose qualifying
// blocks hold at most `total` slots keeps them all; else its max(1, total / block) (KV head, block) pairs with the
// most mass (a block that does not qualify: mass -1), ties to the lower pair. A chosen block is kept whole.
// Returns keep [B, Hkv, n] bool; with `pack`: rows [B, m] int64, each batch row's kept rows of the flat
// [B * Hkv * capacity, d] store, head-major in ascending slots, padded with row 0 to the longest batch row's m,
// head [B, m] int64 (-1 on padding) (else both [B, 0]); counts [B, Hkv] int64; with `with_lse`, lse [B, Hkv, G]
// float32: the log-sum-exp of the scaled scores left unread (-inf where none is, or where their mass underflows
// next to the head's max: each slot below e^-87.3 of it counts 0); else [B, Hkv, 0].
std::vector<torch::Tensor> select_blocks(torch::Tensor scores, double scale, double alpha, int64_t total,
                                         int64_t block, int64_t capacity, bool with_lse, bool pack) {
  TORCH_CHECK(scores.dim() == 4 && scores.scalar_type() == torch::kFloat, "scores [B,Hkv,G,n] float32");
  TORCH_CHECK(total >= 0, "the layer cap must be >= 0");
  TORCH_CHECK(block >= 1, "the block must be >= 1 slot");
  scores = scores.contiguous();
  const int64_t b = scores.size(0), hkv = scores.size(1), g = scores.size(2), n = scores.size(3);
  TORCH_CHECK(capacity >= n, "the store holds fewer slots than the scores cover");
  const int64_t k = std::max<int64_t>(1, std::min(block, n));  // a block over the cached slots is all of them
  const int64_t nb = (n + k - 1) / k;
  const int64_t nblocks = std::max<int64_t>(1, total / k);
  const auto opts = scores.options();
  auto keep = torch::zeros({b, hkv, n}, opts.dtype(torch::kBool));
  auto counts = torch::zeros({b, hkv}, opts.dtype(torch::kLong));
  auto lse = torch::empty({b, hkv, with_lse ? g : 0}, opts);
  std::vector<float> head_max(b * hkv * g), block_mass(b * hkv * nb);
  std::vector<uint8_t> qualifies(b * hkv * nb);
  float* s_p = scores.data_ptr<float>();
  bool* keep_p = keep.data_ptr<bool>();
  int64_t* counts_p = counts.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale), floor_rel = static_cast<float>(-alpha);
  // each (batch row, KV head): scaled scores, each head's max and weights, the group's largest relative, the
  // slots' mass summed over the group, each block's mass and whether it qualifies. One simple loop per step, so
  // that each vectorizes
  at::parallel_for(0, b * hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> group_max(n), mass(n);
    for (int64_t bh = lo; bh < hi; ++bh) {
      std::fill(group_max.begin(), group_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(mass.begin(), mass.end(), 0.f);
      float* gm = group_max.data();
      float* ms = mass.data();
      for (int64_t h = 0; h < g; ++h) {
        float* row = s_p + (bh * g + h) * n;
        float mx = scaled_max(row, n, sc);
        const float sum = exp_relative(row, n, mx, gm);
        head_max[bh * g + h] = mx;
        for (int64_t j = 0; j < n; ++j) ms[j] += row[j] / sum;  // each head's weights, summed over the group
      }
      for (int64_t jb = 0; jb < nb; ++jb) {
        const int64_t lo_j = jb * k, hi_j = std::min(n, lo_j + k);
        float m = 0.f;
        bool q = false;
        for (int64_t j = lo_j; j < hi_j; ++j) {
          m += ms[j];
          q |= gm[j] > floor_rel;
        }
        block_mass[bh * nb + jb] = q ? m : -1.f;
        qualifies[bh * nb + jb] = q;
      }
    }
  });
  // each batch row: its qualifying blocks, or over the cap its top blocks; the chosen blocks' slots kept
  at::parallel_for(0, b, 1, [&](int64_t lo, int64_t hi) {
    std::vector<Block> cand(hkv * nb);
    for (int64_t bi = lo; bi < hi; ++bi) {
      const uint8_t* qp = qualifies.data() + bi * hkv * nb;
      int64_t held = 0;  // the qualifying blocks' slots
      for (int64_t i = 0; i < hkv * nb; ++i) held += qp[i] ? std::min(n, (i % nb + 1) * k) - i % nb * k : 0;
      std::vector<uint8_t> chosen(qp, qp + hkv * nb);
      if (held > total) {
        const float* mp = block_mass.data() + bi * hkv * nb;
        for (int64_t i = 0; i < hkv * nb; ++i) cand[i] = {mp[i], i};
        const int64_t top = std::min(nblocks, hkv * nb);
        std::nth_element(cand.begin(), cand.begin() + (top - 1), cand.end(), before);
        std::fill(chosen.begin(), chosen.end(), 0);
        for (int64_t i = 0; i < top; ++i) chosen[cand[i].index] = 1;
      }
      for (int64_t kh = 0; kh < hkv; ++kh) {
        bool* kp = keep_p + (bi * hkv + kh) * n;
        int64_t c = 0;
        for (int64_t jb = 0; jb < nb; ++jb) {
          if (!chosen[kh * nb + jb]) continue;
          const int64_t lo_j = jb * k, hi_j = std::min(n, lo_j + k);
          std::fill(kp + lo_j, kp + hi_j, true);
          c += hi_j - lo_j;
        }
        counts_p[bi * hkv + kh] = c;
      }
    }
  });
  if (with_lse) {  // the mass each query head leaves unread
    float* lse_p = lse.data_ptr<float>();
    at::parallel_for(0, b * hkv, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> unread(n);
      for (int64_t bh = lo; bh < hi; ++bh) {
        unread_lse(keep_p + bh * n, s_p + bh * g * n, head_max.data() + bh * g, lse_p + bh * g, g, n, unread);
      }
    });
  }
  if (!pack) {
    auto none = torch::empty({b, 0}, opts.dtype(torch::kLong));
    return {keep, none, none, counts, lse};
  }
  auto packed = pack_kept(keep_p, counts_p, b, hkv, n, capacity, opts);
  return {keep, packed.first, packed.second, counts, lse};
}

// keep [B, Hkv, n] bool -> rows, head [B, m] and counts [B, Hkv] int64: `KVStore.select_rows`'s packing of the
// kept slots (every slot of keep a valid one) in one pass.
std::vector<torch::Tensor> pack_rows(torch::Tensor keep, int64_t capacity) {
  TORCH_CHECK(keep.dim() == 3 && keep.scalar_type() == torch::kBool, "keep [B,Hkv,n] bool");
  keep = keep.contiguous();
  const int64_t b = keep.size(0), hkv = keep.size(1), n = keep.size(2);
  TORCH_CHECK(capacity >= n, "the store holds fewer slots than keep covers");
  auto counts = torch::empty({b, hkv}, keep.options().dtype(torch::kLong));
  const bool* keep_p = keep.data_ptr<bool>();
  int64_t* counts_p = counts.data_ptr<int64_t>();
  for (int64_t bh = 0; bh < b * hkv; ++bh) {
    int64_t c = 0;
    for (int64_t j = 0; j < n; ++j) c += keep_p[bh * n + j];
    counts_p[bh] = c;
  }
  auto packed = pack_kept(keep_p, counts_p, b, hkv, n, capacity, keep.options());
  return {packed.first, packed.second, counts};
}

// Where a selection's rows lie in a staging buffer of whole units (the disk tier in blocks: a unit holds `block`
// slots of one (batch row, KV head), `unit_rows` rows each): the units `held` (ids within the layer, ascending,
// id = (batch row * Hkv + KV head) * blocks_per_head + slot / block) are staged first, in that order, and the
// units holding the selection's other rows are to be read after them, ascending. rows, head [B, m]: the packed
// selection (`SelectedRows`: rows of the flat [B * Hkv * capacity, d] store, head -1 on padding). Returns the
// units to read (ids ascending, [M] int64), each packed column's row in the buffer ([B, m] int64: its unit's place
// times unit_rows plus its slot within the block; padding: the first selected entry's row, 0 where none is) and
// the count of selected entries lying in units to read ([1] int64).
std::vector<torch::Tensor> staged_places(torch::Tensor held, torch::Tensor rows, torch::Tensor head,
                                         int64_t capacity, int64_t block, int64_t blocks_per_head,
                                         int64_t unit_rows, int64_t units) {
  TORCH_CHECK(held.dim() == 1 && held.scalar_type() == torch::kLong, "held [U] int64");
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kLong && head.sizes() == rows.sizes() &&
              head.scalar_type() == torch::kLong, "rows, head [B, m] int64");
  TORCH_CHECK(capacity >= 1 && block >= 1 && blocks_per_head >= 1 && unit_rows >= block, "a unit's shape");
  held = held.contiguous();
  rows = rows.contiguous();
  head = head.contiguous();
  const int64_t u = held.numel(), entries = rows.numel();
  const int64_t* held_p = held.data_ptr<int64_t>();
  const int64_t* rows_p = rows.data_ptr<int64_t>();
  const int64_t* head_p = head.data_ptr<int64_t>();
  std::vector<int64_t> place_of(units, -1);  // a unit's place in the buffer; -1: not selected, -2: to be read
  for (int64_t i = 0; i < u; ++i) {
    TORCH_CHECK(held_p[i] >= 0 && held_p[i] < units && (i == 0 || held_p[i] > held_p[i - 1]),
                "held units ascending within the layer");
    place_of[held_p[i]] = i;
  }
  auto unit_of = [&](int64_t row) { return row / capacity * blocks_per_head + row % capacity / block; };
  int64_t missed_rows = 0;
  for (int64_t e = 0; e < entries; ++e) {
    if (head_p[e] < 0) continue;
    const int64_t unit = unit_of(rows_p[e]);
    TORCH_CHECK(rows_p[e] >= 0 && unit < units, "a selected row outside the layer's units");
    if (place_of[unit] < 0) {  // not staged: its unit to be read
      place_of[unit] = -2;
      ++missed_rows;
    }
  }
  std::vector<int64_t> ids;
  for (int64_t unit = 0; unit < units; ++unit)
    if (place_of[unit] == -2) {
      place_of[unit] = u + static_cast<int64_t>(ids.size());
      ids.push_back(unit);
    }
  auto out = torch::empty_like(rows);
  int64_t* out_p = out.data_ptr<int64_t>();
  int64_t first = -1;
  for (int64_t e = 0; e < entries; ++e) {
    if (head_p[e] < 0) continue;
    out_p[e] = place_of[unit_of(rows_p[e])] * unit_rows + rows_p[e] % capacity % block;
    if (first < 0) first = out_p[e];
  }
  for (int64_t e = 0; e < entries; ++e)
    if (head_p[e] < 0) out_p[e] = first < 0 ? 0 : first;
  auto ids_t = torch::tensor(ids, rows.options());
  return {ids_t, out, torch::full({1}, missed_rows, rows.options())};
}

namespace {

// One positioned read per run of adjacent units (runs: file unit, count, place in dst), every run announced first.
// Returns {0, 0}, or {errno, offset} of the read that failed ({-1, offset} where the file ended).
std::vector<int64_t> read_runs(int fd, const std::vector<std::array<int64_t, 3>>& runs, char* base,
                               int64_t unit_bytes, bool willneed) {
#ifdef POSIX_FADV_WILLNEED
  if (willneed)
    for (const auto& run : runs) posix_fadvise(fd, run[0] * unit_bytes, run[1] * unit_bytes, POSIX_FADV_WILLNEED);
#endif
  for (const auto& run : runs) {
    int64_t offset = run[0] * unit_bytes, left = run[1] * unit_bytes;
    char* out = base + run[2] * unit_bytes;
    while (left > 0) {
      const ssize_t n = pread(fd, out, static_cast<size_t>(left), offset);
      if (n < 0) {
        if (errno == EINTR) continue;
        return {errno, offset};
      }
      if (n == 0) return {-1, offset};
      out += n;
      offset += n;
      left -= n;
    }
  }
  return {0, 0};
}

}  // namespace

// Units `ids` of one layer (ids within the layer, ascending, [M] int64) into dst's first M units (a contiguous
// tensor of whole units of `unit_bytes`), each from where it is in fast memory or else from the pool file: an open
// block (id % blocks_per_head == open_j; open_j -1: none) copied from open [Hkv * B units, contiguous], a held unit
// (held ids ascending [H], their data held_data [H units, contiguous]) copied from there, the others read from the
// file at unit file_base + id, one positioned read per run of adjacent units, every run announced first. Runs
// without the GIL. Returns {units read from the file, units copied from the held ones, errno or 0, offset}.
std::vector<int64_t> load_units(int64_t fd, torch::Tensor ids, int64_t file_base, int64_t blocks_per_head,
                                int64_t open_j, torch::Tensor open, torch::Tensor held, torch::Tensor held_data,
                                torch::Tensor dst, int64_t unit_bytes, bool willneed) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong && held.dim() == 1 &&
              held.scalar_type() == torch::kLong, "ids [M], held [H] int64");
  TORCH_CHECK(dst.is_contiguous() && open.is_contiguous() && held_data.is_contiguous(), "contiguous units");
  TORCH_CHECK(held_data.numel() * held_data.element_size() >= held.numel() * unit_bytes, "a held unit's data");
  ids = ids.contiguous();
  held = held.contiguous();
  const int64_t m = ids.numel(), h = held.numel();
  TORCH_CHECK(dst.numel() * dst.element_size() >= m * unit_bytes, "dst holds fewer units than asked");
  const int64_t open_units = open.numel() * open.element_size() / unit_bytes;
  const int64_t* ids_p = ids.data_ptr<int64_t>();
  const int64_t* held_p = held.data_ptr<int64_t>();
  char* base = static_cast<char*>(dst.data_ptr());
  const char* open_p = static_cast<const char*>(open.data_ptr());
  const char* held_d = static_cast<const char*>(held_data.data_ptr());
  std::vector<std::array<int64_t, 3>> runs;  // file unit, count, place
  int64_t read = 0, copied = 0, k = 0;
  pybind11::gil_scoped_release unlocked;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t id = ids_p[i];
    TORCH_CHECK(id >= 0 && (i == 0 || id > ids_p[i - 1]), "ids ascending within the layer");
    if (open_j >= 0 && id % blocks_per_head == open_j) {
      TORCH_CHECK(id / blocks_per_head < open_units, "an open block outside");
      std::memcpy(base + i * unit_bytes, open_p + id / blocks_per_head * unit_bytes, unit_bytes);
      continue;
    }
    while (k < h && held_p[k] < id) ++k;
    if (k < h && held_p[k] == id) {
      std::memcpy(base + i * unit_bytes, held_d + k * unit_bytes, unit_bytes);
      ++copied;
      continue;
    }
    ++read;
    const int64_t at = file_base + id;
    if (!runs.empty() && at == runs.back()[0] + runs.back()[1] && i == runs.back()[2] + runs.back()[1])
      ++runs.back()[1];
    else
      runs.push_back({at, 1, i});
  }
  auto err = read_runs(static_cast<int>(fd), runs, base, unit_bytes, willneed);
  return {read, copied, err[0], err[1]};
}

// `HoldsMisses._hold` of whole units: the units a corrected selection added this step (ids ascending [N], their data
// the first N units of `added`; an open block, id % blocks_per_head == open_j, is not held: it changes as tokens
// arrive) with those held before (prev ids ascending [H], prev_data [H units], prev_last [H]: the step each was last
// added): a previous entry stays where it was not added again and was added after step - hold_steps; past `limit`
// entries the most recently added stay (ties: the held ones before the added, each in ascending ids). Returns the
// ids ascending [K], their data [K units of unit_bytes] (uint8) and last [K].
std::vector<torch::Tensor> hold_units(torch::Tensor prev, torch::Tensor prev_data, torch::Tensor prev_last,
                                      torch::Tensor ids, torch::Tensor added, int64_t blocks_per_head, int64_t open_j,
                                      int64_t step, int64_t hold_steps, int64_t limit, int64_t unit_bytes) {
  TORCH_CHECK(prev.dim() == 1 && prev_last.sizes() == prev.sizes() && ids.dim() == 1, "prev, prev_last [H], ids [N]");
  TORCH_CHECK(prev_data.is_contiguous() && added.is_contiguous(), "contiguous units");
  prev = prev.contiguous();
  prev_last = prev_last.contiguous();
  ids = ids.contiguous();
  const int64_t h = prev.numel(), n = ids.numel();
  TORCH_CHECK(added.numel() * added.element_size() >= n * unit_bytes, "an added unit's data");
  TORCH_CHECK(prev_data.numel() * prev_data.element_size() >= h * unit_bytes, "a held unit's data");
  const int64_t* prev_p = prev.data_ptr<int64_t>();
  const int64_t* last_p = prev_last.data_ptr<int64_t>();
  const int64_t* ids_p = ids.data_ptr<int64_t>();
  struct Entry { int64_t id, last; const char* data; };
  std::vector<Entry> entries;
  entries.reserve(h + n);
  const char* prev_d = static_cast<const char*>(prev_data.data_ptr());
  const char* added_d = static_cast<const char*>(added.data_ptr());
  std::vector<int64_t> closed;  // the added units held: not an open block
  for (int64_t i = 0; i < n; ++i)
    if (open_j < 0 || ids_p[i] % blocks_per_head != open_j) closed.push_back(i);
  size_t j = 0;
  for (int64_t i = 0; i < h; ++i) {  // the held ones not added again, not too old
    while (j < closed.size() && ids_p[closed[j]] < prev_p[i]) ++j;
    if ((j < closed.size() && ids_p[closed[j]] == prev_p[i]) || last_p[i] <= step - hold_steps) continue;
    entries.push_back({prev_p[i], last_p[i], prev_d + i * unit_bytes});
  }
  for (int64_t i : closed) entries.push_back({ids_p[i], step, added_d + i * unit_bytes});
  if (static_cast<int64_t>(entries.size()) > limit) {
    std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.last > b.last; });
    entries.resize(std::max<int64_t>(limit, 0));
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.id < b.id; });
  const int64_t k = entries.size();
  auto opts = prev.options().dtype(torch::kLong);
  auto out_ids = torch::empty({k}, opts), out_last = torch::empty({k}, opts);
  auto out_data = torch::empty({k * unit_bytes}, opts.dtype(torch::kUInt8));
  int64_t* oi = out_ids.data_ptr<int64_t>();
  int64_t* ol = out_last.data_ptr<int64_t>();
  char* od = static_cast<char*>(out_data.data_ptr());
  for (int64_t i = 0; i < k; ++i) {
    oi[i] = entries[i].id;
    ol[i] = entries[i].last;
    std::memcpy(od + i * unit_bytes, entries[i].data, unit_bytes);
  }
  return {out_ids, out_data, out_last};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("load_units", &load_units, "a layer's units from its open blocks, its held units and the pool file");
  m.def("hold_units", &hold_units, "the held units of a corrected layer, merged with those it added");
  m.def("select_blocks", &select_blocks, "InfiniGen's layer-capped block selection from scores to packed rows");
  m.def("pack_rows", &pack_rows, "KVStore.select_rows's packing of kept slots");
  m.def("staged_places", &staged_places, "a selection's rows in a staging buffer of units, and the units to read");
}
