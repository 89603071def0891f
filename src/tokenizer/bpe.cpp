// BPE model; see bpe.h.
#include "tokenizer/bpe.h"

#include <cstdio>
#include <queue>

#include "tokenizer/utf8.h"

namespace ts::tokenizer {

namespace {

uint64_t pair_key(int a, int b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

Result<std::string> optional_string(const nlohmann::json& j, const char* key,
                                    const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::string();
  if (!it->is_string()) return make_error(where + "." + key + ": expected a string or null");
  return it->get<std::string>();
}

}  // namespace

Result<std::unique_ptr<BpeModel>> BpeModel::parse(const nlohmann::json& j,
                                                  const std::string& where) {
  auto m = std::make_unique<BpeModel>();
  auto vocab = j.find("vocab");
  if (vocab == j.end() || !vocab->is_object())
    return make_error(where + ".vocab: missing or not an object of token -> id");
  int max_id = -1;
  m->vocab_.reserve(vocab->size());
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() > INT32_MAX)
      return make_error(where + ".vocab[\"" + it.key() + "\"]: expected a non-negative id");
    int id = it.value().get<int>();
    m->vocab_.emplace(it.key(), id);
    max_id = std::max(max_id, id);
  }
  m->id_to_token_.resize(size_t(max_id + 1));
  for (const auto& [token, id] : m->vocab_) m->id_to_token_[size_t(id)] = token;

  TS_ASSIGN(m->continuing_subword_prefix_, optional_string(j, "continuing_subword_prefix", where));
  TS_ASSIGN(m->end_of_word_suffix_, optional_string(j, "end_of_word_suffix", where));
  TS_ASSIGN(std::string unk, optional_string(j, "unk_token", where));
  // Like Hugging Face, an unk_token missing from the vocab only matters when it is needed;
  // here it then behaves as if there were none (unknown characters are dropped).
  if (!unk.empty()) m->unk_id_ = m->token_to_id(unk);
  m->fuse_unk_ = j.value("fuse_unk", false);
  m->byte_fallback_ = j.value("byte_fallback", false);
  m->ignore_merges_ = j.value("ignore_merges", false);
  if (auto d = j.find("dropout"); d != j.end() && d->is_number() && d->get<double>() > 0.0)
    return make_error(where + ".dropout: BPE dropout (random merges) is not supported");
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    m->byte_ids_[b] = m->token_to_id(name).value_or(-1);
  }

  auto merges = j.find("merges");
  if (merges == j.end() || !merges->is_array())
    return make_error(where + ".merges: missing or not an array");
  m->merges_.reserve(merges->size());
  const size_t prefix_len = m->continuing_subword_prefix_.size();
  std::string a, b;
  for (size_t rank = 0; rank < merges->size(); ++rank) {
    const nlohmann::json& e = (*merges)[rank];
    auto bad = [&](const std::string& why) {
      return make_error(where + ".merges[" + std::to_string(rank) + "]: " + why);
    };
    if (e.is_string()) {
      const std::string& line = e.get_ref<const std::string&>();
      size_t sp = line.find(' ');
      if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos)
        return bad("expected \"left right\" with one space, got \"" + line + "\"");
      a = line.substr(0, sp);
      b = line.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      return bad("expected \"left right\" or [\"left\", \"right\"]");
    }
    auto ia = m->token_to_id(a), ib = m->token_to_id(b);
    if (!ia || !ib) return bad("token '" + (ia ? b : a) + "' is not in the vocab");
    std::string merged = a + (b.size() >= prefix_len ? b.substr(prefix_len) : b);
    auto in = m->token_to_id(merged);
    if (!in) return bad("merged token '" + merged + "' is not in the vocab");
    // A repeated pair keeps the later rank, as Hugging Face's HashMap collect does.
    m->merges_[pair_key(*ia, *ib)] = MergeInfo{int(rank), *in};
  }
  return m;
}

std::optional<int> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

std::string_view BpeModel::id_to_token(int id) const {
  if (id < 0 || size_t(id) >= id_to_token_.size()) return {};
  return id_to_token_[size_t(id)];
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
  auto find_merge = [&](int a, int b) -> const MergeInfo* {
    auto it = merges_.find(pair_key(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  };
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
