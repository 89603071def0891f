// The Hugging Face `tokenizers` library (its official Node binding, npm `tokenizers`, the same
// Rust code as the Python package) for scripts/make_tokenizer_refs.py where the Python package
// is not installed. Reads one JSON request on stdin:
//   {"tokenizer": PATH, "encode": [strings], "decode": [[ids]]}
// and writes {"vocab_size": N, "version": V, "encoded": [{"ids", "ids_special"}],
//   "decoded": [{"decoded", "decoded_skip"}]} to stdout.
// Install: npm install --no-save tokenizers@0.23.2 (node_modules is git-ignored).
const fs = require('fs');
const {Tokenizer} = require('tokenizers');

(async () => {
  const req = JSON.parse(fs.readFileSync(0, 'utf8'));
  const tok = Tokenizer.fromFile(req.tokenizer);
  const out = {
    vocab_size: tok.getVocabSize(true),
    version: require('tokenizers/package.json').version,
    encoded: [],
    decoded: [],
  };
  const opts = (special) => ({addSpecialTokens: special});
  for (const s of req.encode) {
    const a = await tok.encode(s, null, opts(false));
    const b = await tok.encode(s, null, opts(true));
    out.encoded.push({ids: Array.from(a.getIds()), ids_special: Array.from(b.getIds())});
  }
  for (const ids of req.decode) {
    out.decoded.push({decoded: await tok.decode(ids, false), decoded_skip: await tok.decode(ids, true)});
  }
  process.stdout.write(JSON.stringify(out));
})().catch((e) => {
  process.stderr.write(String(e.stack || e) + '\n');
  process.exit(1);
});
