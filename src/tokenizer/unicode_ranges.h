// Sorted tables of code point ranges, as scripts/make_unicode_tables.mjs writes them
// (unicode_*.inc: {first, last[, category]} rows in code point order).
#pragma once

#include <algorithm>
#include <cstddef>

namespace ts::tokenizer {

struct CodeRange {
  char32_t first, last;
};

// The row of `table` whose [first, last] holds c, or nullptr (binary search: the rows are
// sorted and do not overlap).
template <typename Row, size_t N>
const Row* find_code_range(const Row (&table)[N], char32_t c) {
  const Row* r = std::upper_bound(table, table + N, c,
                                  [](char32_t x, const Row& row) { return x < row.first; });
  return r == table || c > (r - 1)->last ? nullptr : r - 1;
}

}  // namespace ts::tokenizer
