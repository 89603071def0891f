// BPE model; see bpe.h.
#include "tokenizer/bpe.h"

#include <cstdio>
#include <queue>

#include "tokenizer/json_util.h"
#include "tokenizer/utf8.h"

namespace ts::tokenizer {

namespace {

uint64_t pair_key(int a, int b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

}  // namespace

void StringIndex::build(const std::vector<std::string>& keys) {
  keys_ = &keys;
  size_t cap = 16;
  while (cap < keys.size() * 2) cap *= 2;
  slots_.assign(cap, 0);
  mask_ = cap - 1;
  for (size_t k = 0; k < keys.size(); ++k) {
    uint64_t h = std::hash<std::string_view>{}(keys[k]);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      if (slots_[i] == 0) {
        slots_[i] = (h >> 32 << 32) | (k + 1);
        break;
      }
    }
  }
}

int StringIndex::find(std::string_view key) const {
  if (slots_.empty()) return -1;
  uint64_t h = std::hash<std::string_view>{}(key);
  for (size_t i = h & mask_;; i = (i + 1) & mask_) {
    uint64_t s = slots_[i];
    if (s == 0) return -1;
    if ((s >> 32) == (h >> 32)) {
      size_t k = size_t(uint32_t(s)) - 1;
      if ((*keys_)[k] == key) return int(k);
    }
  }
}

void BpeModel::PairMap::reserve(size_t n) {
  size_t cap = 16;
  while (cap < n * 2) cap *= 2;
  keys_.assign(cap, kEmpty);
  values_.assign(cap, MergeInfo{});
  mask_ = cap - 1;
}

size_t BpeModel::PairMap::slot(uint64_t key) const {
  // splitmix64 finaliser: the keys are two small ids, which need mixing before masking.
  uint64_t h = key;
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebULL;
  h ^= h >> 31;
  for (size_t i = h & mask_;; i = (i + 1) & mask_)
    if (keys_[i] == key || keys_[i] == kEmpty) return i;
}

void BpeModel::PairMap::put(uint64_t key, MergeInfo v) {
  size_t i = slot(key);
  keys_[i] = key;
  values_[i] = v;
}

const BpeModel::MergeInfo* BpeModel::PairMap::find(uint64_t key) const {
  if (keys_.empty()) return nullptr;
  size_t i = slot(key);
  return keys_[i] == key ? &values_[i] : nullptr;
}

Result<std::unique_ptr<BpeModel>> BpeModel::parse(TokenizerJson& file, const std::string& where) {
  const nlohmann::json& j = file.root["model"];
  auto m = std::make_unique<BpeModel>();
  if (!file.has_vocab) return make_error(where + ".vocab: missing or not an object of token -> id");
  if (!file.vocab_ids_are_integers) return make_error(where + ".vocab: ids must be integers");
  int max_id = -1;
  m->tokens_.reserve(file.vocab.size());
  m->entry_ids_.reserve(file.vocab.size());
  for (auto& [token, id] : file.vocab) {
    if (id < 0 || id > INT32_MAX)
      return make_error(where + ".vocab[\"" + token + "\"]: id " + std::to_string(id) +
                        " is out of range");
    m->tokens_.push_back(std::move(token));
    m->entry_ids_.push_back(int(id));
    max_id = std::max(max_id, int(id));
  }
  file.vocab.clear();
  m->index_.build(m->tokens_);
  m->id_to_entry_.assign(size_t(max_id + 1), -1);
  for (size_t e = 0; e < m->entry_ids_.size(); ++e)
    m->id_to_entry_[size_t(m->entry_ids_[e])] = int(e);

  TS_ASSIGN(m->continuing_subword_prefix_,
            json_string_or(j, "continuing_subword_prefix", "", where));
  TS_ASSIGN(m->end_of_word_suffix_, json_string_or(j, "end_of_word_suffix", "", where));
  TS_ASSIGN(std::string unk, json_string_or(j, "unk_token", "", where));
  // Like Hugging Face, an unk_token missing from the vocab only matters when it is needed;
  // here it then behaves as if there were none (unknown characters are dropped).
  if (!unk.empty()) m->unk_id_ = m->token_to_id(unk);
  TS_ASSIGN(m->fuse_unk_, json_bool_or(j, "fuse_unk", false, where));
  TS_ASSIGN(m->byte_fallback_, json_bool_or(j, "byte_fallback", false, where));
  TS_ASSIGN(m->ignore_merges_, json_bool_or(j, "ignore_merges", false, where));
  if (auto d = j.find("dropout"); d != j.end() && d->is_number() && d->get<double>() > 0.0)
    return make_error(where + ".dropout: BPE dropout (random merges) is not supported");
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    m->byte_ids_[b] = m->token_to_id(name).value_or(-1);
  }

  if (!file.has_merges) return make_error(where + ".merges: missing or not an array");
  if (file.first_bad_merge >= 0)
    return make_error(where + ".merges[" + std::to_string(file.first_bad_merge) +
                      "]: expected \"left right\" or [\"left\", \"right\"]");
  m->merges_.reserve(file.merges.size());
  const size_t prefix_len = m->continuing_subword_prefix_.size();
  std::string merged;
  for (size_t rank = 0; rank < file.merges.size(); ++rank) {
    auto bad = [&](const std::string& why) {
      return make_error(where + ".merges[" + std::to_string(rank) + "]: " + why);
    };
    std::string_view a = file.merges[rank].first, b = file.merges[rank].second;
    if (!file.merge_is_pair[rank]) {
      std::string_view line = a;
      size_t sp = line.find(' ');
      if (sp == std::string_view::npos || line.find(' ', sp + 1) != std::string_view::npos)
        return bad("expected \"left right\" with one space, got \"" + std::string(line) + "\"");
      a = line.substr(0, sp);
      b = line.substr(sp + 1);
    }
    auto ia = m->token_to_id(a), ib = m->token_to_id(b);
    if (!ia || !ib) return bad("token '" + std::string(ia ? b : a) + "' is not in the vocab");
    merged.assign(a);
    merged.append(b.size() >= prefix_len ? b.substr(prefix_len) : b);
    auto in = m->token_to_id(merged);
    if (!in) return bad("merged token '" + merged + "' is not in the vocab");
    // A repeated pair keeps the later rank, as Hugging Face's HashMap collect does.
    m->merges_.put(pair_key(*ia, *ib), MergeInfo{int(rank), *in});
  }
  file.merges.clear();
  return m;
}

std::optional<int> BpeModel::token_to_id(std::string_view token) const {
  int e = index_.find(token);
  if (e < 0) return std::nullopt;
  return entry_ids_[size_t(e)];
}

std::string_view BpeModel::id_to_token(int id) const {
  if (id < 0 || size_t(id) >= id_to_entry_.size() || id_to_entry_[size_t(id)] < 0) return {};
  return tokens_[size_t(id_to_entry_[size_t(id)])];
}

void BpeModel::tokenize(std::string_view word, std::vector<int>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto id = token_to_id(word)) {
      out.push_back(*id);
      return;
    }
  }
  const bool cacheable = word.size() < kMaxCachedBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  size_t first = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() >= kMaxCacheEntries) cache_.clear();
    cache_.emplace(std::string(word), std::vector<int>(out.begin() + long(first), out.end()));
  }
}

void BpeModel::merge_word(std::string_view w, std::vector<int>& out) const {
  struct Symbol {
    int id;
    int prev, next;
    bool removed;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(w.size());
  auto add = [&](int id) {
    int n = int(symbols.size());
    if (n > 0) symbols.back().next = n;
    symbols.push_back({id, n - 1, -1, false});
  };
  // Unknown run waiting to be flushed (fuse_unk joins consecutive unknowns into one).
  bool pending_unk = false;
  std::string s;
  for (size_t i = 0; i < w.size();) {
    size_t start = i;
    next_code_point(w, i);
    s.assign(w.substr(start, i - start));
    if (start > 0 && !continuing_subword_prefix_.empty()) s = continuing_subword_prefix_ + s;
    if (i == w.size() && !end_of_word_suffix_.empty()) s += end_of_word_suffix_;
    if (auto id = token_to_id(s)) {
      if (pending_unk) add(*unk_id_), pending_unk = false;
      add(*id);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (unsigned char c : s) all = all && byte_ids_[c] >= 0;
      if (all) {
        // Hugging Face flushes a pending unk only when a vocab token follows; byte tokens
        // are added before it. Kept identical.
        for (unsigned char c : s) add(byte_ids_[c]);
        continue;
      }
    }
    if (unk_id_) {
      if (pending_unk && !fuse_unk_) add(*unk_id_);
      pending_unk = true;
    }
  }
  if (pending_unk) add(*unk_id_);

  struct Candidate {
    int rank;
    int pos;
    int new_id;
    // std::priority_queue pops the largest: invert so the lowest rank, then the leftmost
    // position, comes first.
    bool operator<(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate> queue;
  auto find_merge = [&](int a, int b) { return merges_.find(pair_key(a, b)); };
  for (size_t k = 0; k + 1 < symbols.size(); ++k) {
    if (const MergeInfo* m = find_merge(symbols[k].id, symbols[k + 1].id))
      queue.push({m->rank, int(k), m->new_id});
  }
  while (!queue.empty()) {
    Candidate top = queue.top();
    queue.pop();
    Symbol& cur = symbols[size_t(top.pos)];
    if (cur.removed || cur.next < 0) continue;
    Symbol& right = symbols[size_t(cur.next)];
    const MergeInfo* now = find_merge(cur.id, right.id);
    if (!now || now->new_id != top.new_id) continue;  // stale entry
    cur.id = top.new_id;
    right.removed = true;
    cur.next = right.next;
    if (cur.next >= 0) symbols[size_t(cur.next)].prev = top.pos;
    if (cur.prev >= 0) {
      if (const MergeInfo* m = find_merge(symbols[size_t(cur.prev)].id, cur.id))
        queue.push({m->rank, cur.prev, m->new_id});
    }
    if (cur.next >= 0) {
      if (const MergeInfo* m = find_merge(cur.id, symbols[size_t(cur.next)].id))
        queue.push({m->rank, top.pos, m->new_id});
    }
  }
  for (const Symbol& sym : symbols)
    if (!sym.removed) out.push_back(sym.id);
}

}  // namespace ts::tokenizer
