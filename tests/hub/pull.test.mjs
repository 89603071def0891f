// `turbospark pull` against a Hub-shaped HTTP server on loopback (node's http module, no
// packages): the repo listing API, resolve URLs (LFS files redirected to a CDN path, small
// files served in place), ETags, Range, a gated repo, a connection dropped mid-file, a file
// whose bytes do not match its hash, a file-size limit standing for a full disk. Then the
// pulled model is loaded with --model ORG/NAME, and a cache written by hand in the
// huggingface_hub layout is found the same way.
//
// Usage: TURBOSPARK_BIN=build/turbospark node --test tests/hub/pull.test.mjs
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import crypto from 'node:crypto';
import fs from 'node:fs';
import http from 'node:http';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const BIN = process.env.TURBOSPARK_BIN ?? path.join(ROOT, 'build/turbospark');
const MODEL_DIR = path.join(ROOT, 'tests/models/qwen3_moe');

const sha256 = (b) => crypto.createHash('sha256').update(b).digest('hex');
const gitSha1 = (b) => crypto.createHash('sha1').update(`blob ${b.length}\0`).update(b).digest('hex');
const commitOf = (name) => crypto.createHash('sha1').update(name).digest('hex');

// A repo file: LFS files are named by their sha256 and redirected to /cdn/, small ones by
// their git sha1 and served by the resolve URL itself.
function file(name, bytes, { lfs = false, etag } = {}) {
  return { name, bytes, lfs, etag: etag ?? (lfs ? sha256(bytes) : gitSha1(bytes)) };
}

const modelFiles = ['config.json', 'generation_config.json', 'tokenizer.json', 'tokenizer_config.json']
  .map((n) => file(n, fs.readFileSync(path.join(MODEL_DIR, n))))
  .concat([
    file('model.safetensors', fs.readFileSync(path.join(MODEL_DIR, 'model.safetensors')), { lfs: true }),
    // Not model files: a default pull leaves them.
    file('README.md', Buffer.from('# a model\n')),
    file('logits.npy', fs.readFileSync(path.join(MODEL_DIR, 'logits.npy')), { lfs: true }),
  ]);
const wrongBytes = Buffer.alloc(200000, 7);

const repos = {
  'org/model': { files: modelFiles },
  'org/gated': { files: modelFiles.slice(0, 1), token: 'hf_good' },
  'org/badhash': {
    files: [modelFiles[0], file('model.safetensors', wrongBytes, { lfs: true, etag: sha256(Buffer.from('other')) })],
  },
  'org/gguf': {
    files: [file('m-Q4_K_M.gguf', Buffer.alloc(70000, 1), { lfs: true }),
            file('m-Q8_0.gguf', Buffer.alloc(90000, 2), { lfs: true }), file('README.md', Buffer.from('x'))],
  },
};
for (const [name, r] of Object.entries(repos)) r.commit = commitOf(name);

// Faults, set per test: cdn[etag] = {drops: how many GETs to cut, after: bytes sent before the cut}.
let faults = {};
let log = [];  // every request: {method, url, range, auth}
let server, base;

function lookup(org, name, rev) {
  const repo = repos[`${org}/${name}`];
  if (!repo) return { status: 404, code: 'RepoNotFound' };
  if (rev !== 'main' && rev !== repo.commit) return { status: 404, code: 'RevisionNotFound' };
  return { repo };
}

function refuse(res, status, code) {
  res.writeHead(status, { 'X-Error-Code': code, 'Content-Type': 'application/json' });
  res.end(JSON.stringify({ error: code }));
}

function serveBytes(req, res, bytes, headers, fault) {
  let start = 0;
  const m = /^bytes=(\d+)-$/.exec(req.headers.range ?? '');
  if (m) start = Number(m[1]);
  if (start > bytes.length) return refuse(res, 416, 'RangeNotSatisfiable');
  const body = bytes.subarray(start);
  res.writeHead(m ? 206 : 200, {
    ...headers, 'Content-Length': body.length, 'Accept-Ranges': 'bytes',
    ...(m ? { 'Content-Range': `bytes ${start}-${bytes.length - 1}/${bytes.length}` } : {}),
  });
  if (req.method === 'HEAD') return res.end();
  if (fault && fault.drops > 0) {
    fault.drops--;
    res.write(body.subarray(0, fault.after), () => setTimeout(() => res.socket.destroy(), 20));
    return;
  }
  res.end(body);
}

function handle(req, res) {
  const url = new URL(req.url, base);
  log.push({ method: req.method, url: url.pathname, range: req.headers.range, auth: req.headers.authorization });
  let m = /^\/api\/models\/([^/]+)\/([^/]+)\/revision\/([^/]+)$/.exec(url.pathname);
  if (m) {
    const { repo, status, code } = lookup(m[1], m[2], decodeURIComponent(m[3]));
    if (!repo) return refuse(res, status, code);
    if (repo.token && req.headers.authorization !== `Bearer ${repo.token}`) return refuse(res, 401, 'GatedRepo');
    res.writeHead(200, { 'Content-Type': 'application/json' });
    return res.end(JSON.stringify({ id: `${m[1]}/${m[2]}`, sha: repo.commit,
      siblings: repo.files.map((f) => ({ rfilename: f.name })) }));
  }
  m = /^\/([^/]+)\/([^/]+)\/resolve\/([^/]+)\/(.+)$/.exec(url.pathname);
  if (m) {
    const { repo, status, code } = lookup(m[1], m[2], m[3]);
    if (!repo) return refuse(res, status, code);
    if (repo.token && req.headers.authorization !== `Bearer ${repo.token}`) return refuse(res, 401, 'GatedRepo');
    const f = repo.files.find((x) => x.name === decodeURIComponent(m[4]));
    if (!f) return refuse(res, 404, 'EntryNotFound');
    if (f.lfs) {
      res.writeHead(302, { Location: `${base}/cdn/${m[1]}/${m[2]}/${f.etag}`, 'X-Repo-Commit': repo.commit,
        'X-Linked-Etag': `"${f.etag}"`, 'X-Linked-Size': f.bytes.length, ETag: `"${gitSha1(Buffer.from(f.etag))}"`,
        'Content-Length': 0 });
      return res.end();
    }
    return serveBytes(req, res, f.bytes, { ETag: `"${f.etag}"`, 'X-Repo-Commit': repo.commit });
  }
  m = /^\/cdn\/([^/]+)\/([^/]+)\/([0-9a-f]+)$/.exec(url.pathname);
  if (m) {
    const f = repos[`${m[1]}/${m[2]}`]?.files.find((x) => x.lfs && x.etag === m[3]);
    if (!f) return refuse(res, 404, 'NotFound');
    return serveBytes(req, res, f.bytes, { ETag: `"${f.etag}"` }, faults[f.etag]);
  }
  refuse(res, 404, 'NotFound');
}

before(async () => {
  server = http.createServer(handle);
  await new Promise((r) => server.listen(0, '127.0.0.1', r));
  base = `http://127.0.0.1:${server.address().port}`;
});
after(() => server.close());

function tempCache() {
  return fs.mkdtempSync(path.join(os.tmpdir(), 'ts-pull-'));
}

// Runs turbospark with the Hub's variables pointing at the test server and `home`'s cache.
function run(args, home, { env = {}, prefix = [], noBin = false } = {}) {
  const fullEnv = { ...process.env, HF_ENDPOINT: base, HF_HOME: home, HF_HUB_CACHE: path.join(home, 'hub'), ...env };
  delete fullEnv.HF_TOKEN;
  if (env.HF_TOKEN) fullEnv.HF_TOKEN = env.HF_TOKEN;
  const cmd = prefix.length ? prefix[0] : BIN;
  const argv = prefix.length ? [...prefix.slice(1), ...(noBin ? [] : [BIN]), ...args] : args;
  const proc = spawn(cmd, argv, { env: fullEnv, stdio: ['ignore', 'pipe', 'pipe'] });
  let stdout = '', stderr = '';
  proc.stdout.on('data', (d) => { stdout += d; });
  proc.stderr.on('data', (d) => { stderr += d; });
  return new Promise((resolve) => proc.on('close', (code) => resolve({ code, stdout, stderr })));
}

// The one error line an input error must give: the last line on stderr (after the plain
// progress lines of the files that did arrive), the only one that says "error".
function assertOneLineError(r, pattern) {
  assert.equal(r.code, 2, r.stderr);
  const lines = r.stderr.trim().split('\n');
  assert.equal(lines.filter((l) => /error/.test(l)).length, 1, r.stderr);
  assert.match(lines.at(-1), /^turbospark \S+: error: /);
  assert.match(lines.at(-1), pattern);
}

const repoDir = (home, repo) => path.join(home, 'hub', `models--${repo.replace('/', '--')}`);
const exists = (p) => { try { fs.lstatSync(p); return true; } catch { return false; } };
const lfsFile = modelFiles.find((f) => f.name === 'model.safetensors');

test('pull fetches the model files into the huggingface_hub layout, resuming a dropped file', async () => {
  const home = tempCache();
  log = [];
  faults = { [lfsFile.etag]: { drops: 1, after: 1 << 20 } };
  const r = await run(['pull', 'org/model'], home);
  assert.equal(r.code, 0, r.stderr);
  const repo = repoDir(home, 'org/model');
  const commit = repos['org/model'].commit;
  const snap = path.join(repo, 'snapshots', commit);
  assert.equal(r.stdout.trim(), snap);
  assert.equal(fs.readFileSync(path.join(repo, 'refs', 'main'), 'utf8'), commit);
  const wanted = ['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json'];
  assert.deepEqual(fs.readdirSync(snap).sort(), wanted);
  for (const name of wanted) {
    const f = modelFiles.find((x) => x.name === name);
    assert.equal(fs.readlinkSync(path.join(snap, name)), `../../blobs/${f.etag}`);
    assert.ok(fs.readFileSync(path.join(snap, name)).equals(f.bytes), name);
  }
  assert.deepEqual(fs.readdirSync(path.join(repo, 'blobs')).sort(),
    wanted.map((n) => modelFiles.find((x) => x.name === n).etag).sort());
  // The drop was resumed where it stopped, with a Range request.
  const cdn = log.filter((e) => e.method === 'GET' && e.url.endsWith(lfsFile.etag));
  assert.equal(cdn.length, 2, JSON.stringify(cdn));
  assert.equal(cdn[0].range, undefined);
  assert.match(cdn[1].range ?? '', /^bytes=[1-9]\d*-$/);
  assert.ok(Number(/\d+/.exec(cdn[1].range)[0]) >= 1 << 20, cdn[1].range);
  assert.ok(!log.some((e) => e.url.includes('README') || e.url.includes('logits')), 'only model files');

  // Again: everything is in the cache, nothing is fetched.
  log = [];
  const again = await run(['pull', 'org/model'], home);
  assert.equal(again.code, 0, again.stderr);
  assert.equal(log.filter((e) => e.url.includes('/resolve/') || e.url.includes('/cdn/')).length, 0, JSON.stringify(log));
  assert.match(again.stderr, /already in the cache/);

  // The pulled model loads through --model ORG/NAME, offline, as the directory does.
  const viaRepo = await run(['generate', '--model', 'org/model', '--tokens', '1,2,3,4', '-n', '6'], home,
    { env: { HF_ENDPOINT: 'http://127.0.0.1:1' } });
  const viaDir = await run(['generate', '--model', MODEL_DIR, '--tokens', '1,2,3,4', '-n', '6'], home);
  assert.equal(viaRepo.code, 0, viaRepo.stderr);
  assert.equal(viaRepo.stdout, viaDir.stdout);
  const inspect = await run(['inspect', '--model', 'org/model', '--json'], home);
  assert.equal(inspect.code, 0, inspect.stderr);
  const inspectDir = await run(['inspect', '--model', MODEL_DIR, '--json'], home);
  const strip = (s) => { const j = JSON.parse(s); delete j.model; return j; };
  assert.deepEqual(strip(inspect.stdout), strip(inspectDir.stdout));
  const byCommit = await run(['inspect', '--model', `org/model@${commit}`], home);
  assert.equal(byCommit.code, 0, byCommit.stderr);
  fs.rmSync(home, { recursive: true });
});

test('a pull cut short leaves no snapshot to load and resumes on the next pull', async () => {
  const home = tempCache();
  faults = { [lfsFile.etag]: { drops: 100, after: 100000 } };
  const r = await run(['pull', 'org/model'], home);
  assertOneLineError(r, /model\.safetensors.*next pull resumes/);
  const repo = repoDir(home, 'org/model');
  const commit = repos['org/model'].commit;
  assert.ok(!exists(path.join(repo, 'refs', 'main')), 'no ref before every file is in');
  assert.ok(!exists(path.join(repo, 'snapshots', commit, 'model.safetensors')));
  assert.ok(!exists(path.join(repo, 'blobs', lfsFile.etag)));
  const partial = fs.statSync(path.join(repo, 'blobs', `${lfsFile.etag}.incomplete`)).size;
  assert.ok(partial > 0 && partial < lfsFile.bytes.length, String(partial));
  const load = await run(['inspect', '--model', 'org/model'], home);
  assertOneLineError(load, /turbospark pull org\/model/);

  faults = {};
  log = [];
  const again = await run(['pull', 'org/model'], home);
  assert.equal(again.code, 0, again.stderr);
  const cdn = log.filter((e) => e.method === 'GET' && e.url.endsWith(lfsFile.etag));
  assert.equal(cdn.length, 1);
  assert.equal(cdn[0].range, `bytes=${partial}-`);
  assert.ok(fs.readFileSync(path.join(repo, 'snapshots', commit, 'model.safetensors')).equals(lfsFile.bytes));
  assert.ok(!exists(path.join(repo, 'blobs', `${lfsFile.etag}.incomplete`)));
  fs.rmSync(home, { recursive: true });
});

test('a file whose bytes do not match its hash is refused and deleted', async () => {
  const home = tempCache();
  faults = {};
  const r = await run(['pull', 'org/badhash'], home);
  assertOneLineError(r, /model\.safetensors: SHA-256 .* deleted/);
  const repo = repoDir(home, 'org/badhash');
  const etag = repos['org/badhash'].files[1].etag;
  assert.ok(!exists(path.join(repo, 'blobs', etag)));
  assert.ok(!exists(path.join(repo, 'blobs', `${etag}.incomplete`)));
  assert.ok(!exists(path.join(repo, 'snapshots', repos['org/badhash'].commit, 'model.safetensors')));
  assert.ok(!exists(path.join(repo, 'refs', 'main')));
  fs.rmSync(home, { recursive: true });
});

test('on a terminal, one progress line is rewritten in place', async () => {
  const home = tempCache();
  faults = {};
  // script(1) runs the command on a pseudo-terminal; its output is stdout and stderr together.
  const quoted = [BIN, 'pull', 'org/model'].map((a) => `'${a}'`).join(' ');
  const r = await run([], home, { prefix: ['script', '-qec', quoted, '/dev/null'], noBin: true });
  assert.equal(r.code, 0, r.stdout);
  assert.match(r.stdout, /\r\x1b\[Kturbospark pull: 5\/5 files, 3\.7 MB \/ 3\.7 MB, [\d.]+ MB\/s\r?\n/);
  assert.doesNotMatch(r.stdout, /config\.json: 977 B/);  // no plain per-file lines
  fs.rmSync(home, { recursive: true });
});

test('a gated repo needs HF_TOKEN, which is sent as a bearer token', async () => {
  const home = tempCache();
  const r = await run(['pull', 'org/gated'], home);
  assertOneLineError(r, /gated.*HF_TOKEN/);
  log = [];
  const ok = await run(['pull', 'org/gated'], home, { env: { HF_TOKEN: 'hf_good' } });
  assert.equal(ok.code, 0, ok.stderr);
  assert.ok(log.length > 0 && log.every((e) => e.auth === 'Bearer hf_good'), JSON.stringify(log));
  fs.rmSync(home, { recursive: true });
});

test('bad input: unknown repo, unknown revision, no network, bad name, full disk', async () => {
  const home = tempCache();
  assertOneLineError(await run(['pull', 'org/nothing'], home), /org\/nothing: no such model/);
  assertOneLineError(await run(['pull', 'org/model@v9'], home), /no revision 'v9'/);
  assertOneLineError(await run(['pull', 'org/model'], home, { env: { HF_ENDPOINT: 'http://127.0.0.1:1' } }),
    /cannot reach http:\/\/127\.0\.0\.1:1/);
  assertOneLineError(await run(['pull', 'not-a-repo'], home), /not ORG\/NAME/);
  assertOneLineError(await run(['pull', 'org/model', '--bogus', 'x'], home), /bogus/);
  // A file-size limit of 512 kB: the write fails as on a full disk.
  faults = {};
  const full = await run(['pull', 'org/model'], home, { prefix: ['sh', '-c', 'ulimit -f 1024; exec "$0" "$@"'] });
  assertOneLineError(full, /writing .*incomplete: File too large/);
  const snap = path.join(repoDir(home, 'org/model'), 'snapshots', repos['org/model'].commit);
  assert.ok(!exists(path.join(snap, 'model.safetensors')));
  assert.ok(!exists(path.join(repoDir(home, 'org/model'), 'refs', 'main')));
  fs.rmSync(home, { recursive: true });
});

test('GGUF repos: the user picks files with --include', async () => {
  const home = tempCache();
  const r = await run(['pull', 'org/gguf'], home);
  assertOneLineError(r, /GGUF.*--include.*m-Q4_K_M\.gguf, m-Q8_0\.gguf/);
  const ok = await run(['pull', 'org/gguf', '--include', '*Q4_K_M*'], home);
  assert.equal(ok.code, 0, ok.stderr);
  const snap = path.join(repoDir(home, 'org/gguf'), 'snapshots', repos['org/gguf'].commit);
  assert.deepEqual(fs.readdirSync(snap), ['m-Q4_K_M.gguf']);
  assert.ok(fs.readFileSync(path.join(snap, 'm-Q4_K_M.gguf')).equals(repos['org/gguf'].files[0].bytes));
  fs.rmSync(home, { recursive: true });
});

test('a cache written by hand in the huggingface_hub layout is found by --model ORG/NAME', async () => {
  const home = tempCache();
  const repo = repoDir(home, 'someone/hand-made');
  const commit = '0123456789abcdef0123456789abcdef01234567';
  const snap = path.join(repo, 'snapshots', commit);
  fs.mkdirSync(path.join(repo, 'blobs'), { recursive: true });
  fs.mkdirSync(path.join(repo, 'refs'));
  fs.mkdirSync(snap, { recursive: true });
  for (const name of ['config.json', 'generation_config.json', 'tokenizer.json', 'tokenizer_config.json', 'model.safetensors']) {
    const bytes = fs.readFileSync(path.join(MODEL_DIR, name));
    const etag = name.endsWith('.safetensors') ? sha256(bytes) : gitSha1(bytes);
    fs.writeFileSync(path.join(repo, 'blobs', etag), bytes);
    fs.symlinkSync(`../../blobs/${etag}`, path.join(snap, name));
  }
  fs.writeFileSync(path.join(repo, 'refs', 'main'), commit);
  const env = { HF_ENDPOINT: 'http://127.0.0.1:1' };  // offline
  const gen = await run(['generate', '--model', 'someone/hand-made', '--tokens', '5,6,7', '-n', '4'], home, { env });
  const dir = await run(['generate', '--model', MODEL_DIR, '--tokens', '5,6,7', '-n', '4'], home, { env });
  assert.equal(gen.code, 0, gen.stderr);
  assert.equal(gen.stdout, dir.stdout);
  const tok = path.join(home, 'in.jsonl');
  fs.writeFileSync(tok, '"the cat"\n');
  const t1 = await run(['tokenize', '--model', 'someone/hand-made', '--input', tok], home, { env });
  const t2 = await run(['tokenize', '--model', MODEL_DIR, '--input', tok], home, { env });
  assert.equal(t1.code, 0, t1.stderr);
  assert.equal(t1.stdout, t2.stdout);
  assert.equal((await run(['inspect', '--model', `someone/hand-made@${commit}`], home, { env })).code, 0);
  assertOneLineError(await run(['inspect', '--model', 'someone/missing'], home, { env }),
    /someone\/missing: no such file or directory.*turbospark pull someone\/missing/);
  assertOneLineError(await run(['inspect', '--model', 'someone/hand-made@v2'], home, { env }),
    /turbospark pull someone\/hand-made@v2/);
  fs.rmSync(home, { recursive: true });
});
