#include <gtest/gtest.h>

#include <string>

#include "core/sha256.h"

TEST(Sha256, KnownVectors) {
  auto h = [](const std::string& s) {
    ts::Sha256 x;
    x.update(s.data(), s.size());
    return x.hex_digest();
  };
  EXPECT_EQ(h(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(h("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(h("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // Fed in uneven pieces: the same digest as in one piece.
  std::string big(100000, 'a');
  for (size_t i = 0; i < big.size(); ++i) big[i] = char('a' + i * 7 % 26);
  ts::Sha256 pieces;
  for (size_t i = 0; i < big.size();) {
    size_t n = std::min<size_t>(1 + i % 97, big.size() - i);
    pieces.update(big.data() + i, n);
    i += n;
  }
  EXPECT_EQ(pieces.hex_digest(), h(big));
}
