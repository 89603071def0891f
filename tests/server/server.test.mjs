// End-to-end tests of `turbospark serve` with the official OpenAI and Anthropic clients, raw
// HTTP for malformed input and auth, a load test and disconnecting clients.
//
// The model (tests/models/qwen3_moe) has random weights: its text is noise, so the tests
// check structure, determinism (greedy output must equal `turbospark run`'s and must not
// depend on what other clients do) and error handling. Tool calls and reasoning come from a
// second server whose replies are fixed by the TURBOSPARK_SERVE_TEST_REPLY test hook (the
// model still runs on those tokens).
//
// Usage: TURBOSPARK_BIN=build/turbospark node tests/server/server.test.mjs
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { post, stopServer } from './http_helpers.mjs';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';
import { Ollama } from 'ollama';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const BIN = process.env.TURBOSPARK_BIN ?? path.join(ROOT, 'build/turbospark');
const MODEL_DIR = path.join(ROOT, 'tests/models/qwen3_moe');
const MODEL = 'qwen3_moe';
const TMP = mkdtempSync(path.join(tmpdir(), 'ts-serve-'));

// Starts `turbospark serve` on a free port; resolves once it listens.
function startServer(args = [], env = {}) {
  const proc = spawn(BIN, ['serve', '--model', MODEL_DIR, '--port', '0', ...args], {
    env: { ...process.env, TURBOSPARK_API_KEY: '', ...env },
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  let log = '';
  return new Promise((resolve, reject) => {
    proc.stderr.on('data', (d) => {
      log += d;
      const m = log.match(/http:\/\/127\.0\.0\.1:(\d+)/);
      if (m && !proc.port) {
        proc.port = Number(m[1]);
        resolve({ proc, base: `http://127.0.0.1:${proc.port}`, log: () => log });
      }
    });
    proc.on('exit', (code) => reject(new Error(`serve exited with ${code}: ${log}`)));
  });
}

// The CLI's greedy reply, the reference for the server's (run prints a final newline).
function cliRun(args) {
  const out = execFileSync(BIN, ['run', '--model', MODEL_DIR, ...args], { encoding: 'utf8' });
  assert.ok(out.endsWith('\n'));
  return out.slice(0, -1);
}

function messagesFile(messages) {
  const f = path.join(TMP, `m${Math.random().toString(36).slice(2)}.json`);
  writeFileSync(f, JSON.stringify(messages));
  return f;
}

async function metric(base, name) {
  const text = await (await fetch(base + '/metrics')).text();
  const m = text.match(new RegExp(`^${name} (\\S+)$`, 'm'));
  assert.ok(m, `metric ${name} missing`);
  return Number(m[1]);
}

let main; // the plain server
let openai, anthropic;
// A prompt whose greedy reply (noise) has varied characters and no early EOS.
const HELLO = [{ role: 'user', content: 'write a poem' }];
const N = 16;

before(async () => {
  main = await startServer(['--max-body-bytes', '65536']);
  openai = new OpenAI({ baseURL: main.base + '/v1', apiKey: 'unused', maxRetries: 0 });
  anthropic = new Anthropic({ baseURL: main.base, apiKey: 'unused', maxRetries: 0 });
});

after(async () => { await stopServer(main); });

test('models and health', async () => {
  const models = await openai.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
  const health = await fetch(main.base + '/health');
  assert.equal(health.status, 200);
  assert.deepEqual(await health.json(), { status: 'ok' });
  const metrics = await (await fetch(main.base + '/metrics')).text();
  assert.match(metrics, /^turbospark_engine_threads 1$/m);
  assert.match(metrics, /^# TYPE turbospark_queue_depth gauge$/m);
  assert.match(metrics, /^turbospark_expert_cache_hit_rate /m);
});

test('chat: non-stream and stream equal the CLI at temperature 0', async () => {
  const want = cliRun(['--messages', messagesFile(HELLO), '-n', String(N)]);
  const r = await openai.chat.completions.create({ model: MODEL, messages: HELLO, max_tokens: N, temperature: 0 });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.model, MODEL);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(r.choices[0].message.content, want);
  const { prompt_tokens, completion_tokens, total_tokens } = r.usage;
  assert.ok(prompt_tokens > 5);
  assert.equal(total_tokens, prompt_tokens + completion_tokens);
  if (r.choices[0].finish_reason === 'length') assert.equal(completion_tokens, N);
  else assert.ok(completion_tokens < N);

  const stream = await openai.chat.completions.create({
    model: MODEL, messages: HELLO, max_tokens: N, stream: true, stream_options: { include_usage: true },
  });
  let text = '';
  let finish = null;
  let usage = null;
  let chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    assert.equal(chunk.object, 'chat.completion.chunk');
    if (chunk.usage) {
      usage = chunk.usage;
      assert.equal(chunk.choices.length, 0);
      continue;
    }
    assert.equal(finish, null, 'no content after the finish chunk');
    text += chunk.choices[0].delta.content ?? '';
    finish = chunk.choices[0].finish_reason;
  }
  assert.ok(chunks > 3);
  assert.equal(text, want);
  assert.equal(finish, r.choices[0].finish_reason);
  assert.deepEqual(usage, r.usage);
});

test('completions: non-stream and stream equal the CLI', async () => {
  const prompt = 'the cat is on the mat';
  const want = cliRun(['--prompt', prompt, '-n', String(N)]);
  const r = await openai.completions.create({ model: MODEL, prompt, max_tokens: N });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices[0].text, want);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
  let text = '';
  for await (const c of await openai.completions.create({ model: MODEL, prompt, max_tokens: N, stream: true })) {
    text += c.choices[0]?.text ?? '';
  }
  assert.equal(text, want);
});

// The rows of a float32 .npy file written by `turbospark logits` (one per prompt position).
function npyRows(file) {
  const b = readFileSync(file);
  const headerLen = b.readUInt16LE(8);
  const header = b.subarray(10, 10 + headerLen).toString('latin1');
  const shape = header.match(/'shape': \(([^)]*)\)/)[1].split(',').filter((x) => x.trim()).map(Number);
  const cols = shape[shape.length - 1];
  const data = new Float32Array(b.buffer.slice(b.byteOffset + 10 + headerLen, b.byteOffset + b.length));
  const rows = [];
  for (let at = 0; at < data.length; at += cols) rows.push(Array.from(data.subarray(at, at + cols)));
  return rows;
}

// log-softmax of a row of logits.
function logSoftmax(row) {
  const mx = Math.max(...row);
  const logZ = mx + Math.log(row.reduce((s, x) => s + Math.exp(x - mx), 0));
  return row.map((x) => x - logZ);
}

test('logprobs: chat and completions, the first token against the logits the CLI prints', async () => {
  // Greedy: each token is its step's likeliest, so its logprob is the top alternative's.
  const ids = [1, 7, 42, 99, 150, 3];
  const r = await openai.completions.create({
    model: MODEL, prompt: ids, max_tokens: 6, temperature: 0, logprobs: 3 });
  const lp = r.choices[0].logprobs;
  assert.equal(lp.tokens.length, r.usage.completion_tokens);
  assert.equal(lp.token_logprobs.length, lp.tokens.length);
  assert.equal(lp.text_offset[0], 0);
  for (let i = 0; i < lp.tokens.length; i++) {
    assert.ok(lp.token_logprobs[i] <= 0);
    const alts = Object.values(lp.top_logprobs[i]);
    assert.ok(alts.length >= 1 && alts.length <= 3);
    assert.equal(Math.max(...alts), lp.token_logprobs[i]);
  }
  // log-softmax of the prompt's last logits, computed here.
  const file = path.join(TMP, 'logits.npy');
  execFileSync(BIN, ['logits', '--model', MODEL_DIR, '--tokens', ids.join(','), '--out', file]);
  const rows = npyRows(file);
  assert.equal(rows.length, ids.length);
  const want = logSoftmax(rows[rows.length - 1]).sort((a, b) => b - a).slice(0, 3);
  assert.ok(Math.abs(lp.token_logprobs[0] - want[0]) < 1e-4, `${lp.token_logprobs[0]} vs ${want[0]}`);
  const got = Object.values(lp.top_logprobs[0]).sort((a, b) => b - a);
  for (let k = 0; k < got.length; k++) assert.ok(Math.abs(got[k] - want[k]) < 1e-4, `top ${k}`);

  // echo with max_tokens 0 scores the prompt (as evaluation harnesses do): token i's logprob
  // is row i - 1's log-softmax at ids[i]; the first has none.
  const e = await openai.completions.create({
    model: MODEL, prompt: ids, max_tokens: 0, echo: true, logprobs: 1 });
  const elp = e.choices[0].logprobs;
  assert.equal(e.usage.completion_tokens, 0);
  assert.equal(elp.tokens.length, ids.length);
  assert.equal(elp.token_logprobs[0], null);
  assert.equal(elp.top_logprobs[0], null);
  for (let i = 1; i < ids.length; i++) {
    const w = logSoftmax(rows[i - 1])[ids[i]];
    assert.ok(Math.abs(elp.token_logprobs[i] - w) < 1e-4, `position ${i}: ${elp.token_logprobs[i]} vs ${w}`);
  }
  assert.equal(e.choices[0].text, elp.tokens.join(''));
  // A longer prompt: its rows are scored in ranges on the engine's thread pool, every one
  // against the CLI's logits, and the top alternatives sorted.
  const long = Array.from({ length: 40 }, (_, i) => (i * 37 + 11) % 400);
  const longFile = path.join(TMP, 'logits_long.npy');
  execFileSync(BIN, ['logits', '--model', MODEL_DIR, '--tokens', long.join(','), '--out', longFile]);
  const longRows = npyRows(longFile);
  const el = (await openai.completions.create({
    model: MODEL, prompt: long, max_tokens: 0, echo: true, logprobs: 2 })).choices[0].logprobs;
  assert.equal(el.token_logprobs.length, long.length);
  for (let i = 1; i < long.length; i++) {
    const all = logSoftmax(longRows[i - 1]);
    assert.ok(Math.abs(el.token_logprobs[i] - all[long[i]]) < 1e-4, `long position ${i}`);
    const top = Object.values(el.top_logprobs[i]).sort((a, b) => b - a);
    const best = [...all].sort((a, b) => b - a);
    top.forEach((x, k) => assert.ok(Math.abs(x - best[k]) < 1e-4, `long position ${i} top ${k}`));
  }
  // echo then generation: the prompt's entries, then the completion's, as without echo (the
  // prompt's last token is recomputed alone after the whole prefill: equal to float rounding).
  const e2 = await openai.completions.create({
    model: MODEL, prompt: ids, max_tokens: 6, temperature: 0, echo: true, logprobs: 3 });
  const gen2 = e2.choices[0].logprobs.token_logprobs.slice(ids.length);
  assert.equal(gen2.length, lp.token_logprobs.length);
  gen2.forEach((x, i) => assert.ok(Math.abs(x - lp.token_logprobs[i]) < 1e-4, `token ${i}`));
  assert.ok(e2.choices[0].text.endsWith(r.choices[0].text));

  const c = await openai.chat.completions.create({
    model: MODEL, messages: HELLO, max_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 2 });
  const content = c.choices[0].logprobs.content;
  assert.equal(content.length, c.usage.completion_tokens);
  for (const t of content) {
    // A token that is part of a character reads U+FFFD; its bytes are the part.
    if (!t.token.includes('\uFFFD')) assert.deepEqual(t.bytes, Array.from(Buffer.from(t.token, 'utf8')));
    assert.equal(t.top_logprobs.length, 2);
    assert.equal(t.top_logprobs[0].logprob, t.logprob);
    assert.ok(t.top_logprobs[1].logprob <= t.top_logprobs[0].logprob);
  }
  // Streamed: the entries arrive with the chunks, and add up to the non-streamed ones.
  const streamed = [];
  let streamedText = '';
  for await (const chunk of await openai.chat.completions.create({
    model: MODEL, messages: HELLO, max_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 2, stream: true })) {
    streamedText += chunk.choices[0]?.delta?.content ?? '';
    streamed.push(...(chunk.choices[0]?.logprobs?.content ?? []));
  }
  assert.equal(streamedText, c.choices[0].message.content);
  // (The same tokens; values to float rounding: a repeated prompt reuses the cached KV rows
  // and recomputes only its last token, a different summation order.)
  const near = (a, b, what) => assert.ok(Math.abs(a - b) < 1e-4, `${what}: ${a} vs ${b}`);
  assert.equal(streamed.length, content.length);
  streamed.forEach((t, i) => {
    assert.equal(t.token, content[i].token);
    assert.deepEqual(t.bytes, content[i].bytes);
    near(t.logprob, content[i].logprob, `token ${i}`);
    assert.deepEqual(t.top_logprobs.map((x) => x.token), content[i].top_logprobs.map((x) => x.token));
  });
  const cstream = { tokens: [], token_logprobs: [], text_offset: [] };
  for await (const chunk of await openai.completions.create({
    model: MODEL, prompt: ids, max_tokens: 6, temperature: 0, logprobs: 3, stream: true })) {
    const l = chunk.choices[0]?.logprobs;
    if (!l) continue;
    cstream.tokens.push(...l.tokens);
    cstream.token_logprobs.push(...l.token_logprobs);
    cstream.text_offset.push(...l.text_offset);
  }
  assert.deepEqual(cstream.tokens, lp.tokens);
  cstream.token_logprobs.forEach((x, i) => near(x, lp.token_logprobs[i], `completion token ${i}`));
  assert.deepEqual(cstream.text_offset, lp.text_offset);
  const plain = await openai.chat.completions.create({ model: MODEL, messages: HELLO, max_tokens: 8, temperature: 0 });
  assert.equal(plain.choices[0].logprobs, null);
  assert.equal(plain.choices[0].message.content, c.choices[0].message.content);
  await assert.rejects(
    openai.chat.completions.create({ model: MODEL, messages: HELLO, top_logprobs: 2 }),
    (e) => e.status === 400 && /top_logprobs/.test(e.message));
  await assert.rejects(
    openai.completions.create({ model: MODEL, prompt: ids, echo: true, stream: true }),
    (e) => e.status === 400 && /echo/.test(e.message));
});

test('sampling: a seed reproduces, penalties and min_p are accepted', async () => {
  const ask = (seed, extra = {}) => openai.chat.completions.create({
    model: MODEL, messages: HELLO, max_tokens: 24, temperature: 1.2, top_p: 0.95, top_k: 50, seed, ...extra,
  }).then((r) => r.choices[0].message.content);
  const a = await ask(7);
  assert.equal(await ask(7), a);
  const others = [await ask(8), await ask(9), await ask(10)];
  assert.ok(others.some((t) => t !== a), 'different seeds should give different samples');
  const pen = await ask(7, { presence_penalty: 1.5, frequency_penalty: 1.0, min_p: 0.05 });
  assert.equal(await ask(7, { presence_penalty: 1.5, frequency_penalty: 1.0, min_p: 0.05 }), pen);
});

test('logit_bias: the same reply as the CLI with the same biases; ids past the vocabulary are a 400', async () => {
  const prompt = 'the cat is on the mat';
  const plain = cliRun(['--prompt', prompt, '-n', '8']);
  for (const bias of [{ 300: 100 }, { 300: 100, 301: -5 }, { 17: -100, 42: -100 }]) {
    const flags = Object.entries(bias).flatMap(([id, b]) => ['--logit-bias', `${id}=${b}`]);
    const want = cliRun(['--prompt', prompt, '-n', '8', ...flags]);
    const r = await openai.completions.create({ model: MODEL, prompt, max_tokens: 8, logit_bias: bias });
    assert.equal(r.choices[0].text, want, JSON.stringify(bias));
    const c = await openai.chat.completions.create({
      model: MODEL, messages: HELLO, max_tokens: 8, logit_bias: bias,
    });
    assert.equal(c.choices[0].message.content,
      cliRun(['--messages', messagesFile(HELLO), '-n', '8', ...flags]), JSON.stringify(bias));
  }
  // +100 on one token: greedy takes it every time, so the reply differs from the plain one.
  assert.notEqual(cliRun(['--prompt', prompt, '-n', '8', '--logit-bias', '300=100']), plain);
  for (const [bias, needle] of [[{ 512: 1 }, 'outside the vocabulary'], [{ x: 1 }, 'not a token id'],
    [{ 3: 200 }, 'between -100 and 100']]) {
    const r = await post(main.base, '/v1/completions', { prompt, max_tokens: 2, logit_bias: bias });
    assert.equal(r.status, 400, r.text);
    assert.equal(r.json.error.param, 'logit_bias');
    assert.ok(r.json.error.message.includes(needle), r.json.error.message);
  }
});

test('response_format json_object: the reply is a JSON object, streamed alike', async () => {
  // The fixture's tokenizer: '}' is 125, <|im_end|> (EOS) 402. Biases toward them make the
  // noise model close its object at once; without them it must still keep to JSON.
  const ask = (extra) => openai.chat.completions.create({
    model: MODEL, messages: HELLO, max_tokens: 64, response_format: { type: 'json_object' }, ...extra,
  });
  const closed = await ask({ logit_bias: { 125: 30, 402: 60 } });
  assert.equal(closed.choices[0].finish_reason, 'stop');
  assert.deepEqual(JSON.parse(closed.choices[0].message.content), {});
  for (const seed of [1, 2, 3]) {
    const r = await ask({ temperature: 1.0, seed, logit_bias: { 402: 8 } });
    const text = r.choices[0].message.content;
    assert.match(text, /^\s*\{/, text);
    if (r.choices[0].finish_reason === 'stop') {
      const v = JSON.parse(text);
      assert.equal(typeof v, 'object');
      assert.ok(v !== null && !Array.isArray(v), text);
    }
    let streamed = '';
    for await (const c of await ask({ temperature: 1.0, seed, logit_bias: { 402: 8 }, stream: true }))
      streamed += c.choices[0]?.delta?.content ?? '';
    assert.equal(streamed, text);
  }
});

test('response_format json_schema: replies the schema accepts, streamed alike; unsupported rules are a 400 naming them', async () => {
  const schema = {
    type: 'object',
    properties: {
      city: { type: 'string' }, days: { type: 'integer' },
      unit: { enum: ['C', 'F'] }, tags: { type: 'array', items: { type: 'string' }, maxItems: 2 },
    },
    required: ['city', 'days', 'unit'], additionalProperties: false,
  };
  const format = { type: 'json_schema', json_schema: { name: 'weather', strict: true, schema } };
  // The fixture's '"' (34), ',' (44), '}' (125) and EOS (402) a little likelier, so the noise
  // model closes its strings and its object within the budget; the schema still decides.
  const logit_bias = { 34: 4, 44: 3, 125: 3, 402: 8 };
  let stopped = 0;
  for (const seed of [1, 2, 3, 4]) {
    const ask = (extra) => openai.chat.completions.create({
      model: MODEL, messages: HELLO, max_tokens: 96, temperature: 1.0, seed,
      response_format: format, logit_bias, ...extra });
    const r = await ask({});
    const text = r.choices[0].message.content;
    if (r.choices[0].finish_reason === 'stop') {
      stopped++;
      const v = JSON.parse(text);
      assert.deepEqual(Object.keys(v).filter((k) => !(k in schema.properties)), [], text);
      assert.equal(typeof v.city, 'string', text);
      assert.ok(Number.isInteger(v.days), text);
      assert.ok(['C', 'F'].includes(v.unit), text);
      if ('tags' in v) assert.ok(Array.isArray(v.tags) && v.tags.length <= 2, text);
    }
    let streamed = '';
    for await (const c of await ask({ stream: true })) streamed += c.choices[0]?.delta?.content ?? '';
    assert.equal(streamed, text);
  }
  assert.ok(stopped > 0, 'no reply finished its object within 96 tokens');
  // Ollama's format takes the same schemas.
  const ollama = new Ollama({ host: main.base });
  const o = await ollama.chat({ model: MODEL, messages: HELLO, format: schema, stream: false,
    options: { temperature: 1.0, seed: 5, num_predict: 96 } });
  if (o.done_reason === 'stop') assert.ok(['C', 'F'].includes(JSON.parse(o.message.content).unit));
  const bad = await post(main.base, '/v1/chat/completions', {
    messages: HELLO,
    response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'object', properties: { a: { type: 'string', pattern: '^a' } } } } },
  });
  assert.equal(bad.status, 400, bad.text);
  assert.equal(bad.json.error.param, 'response_format');
  assert.match(bad.json.error.message, /pattern/);
});

test('n: choices one after another, choice i as a request with seed + i; usage summed; not streamed', async () => {
  const ask = (n, seed) => openai.chat.completions.create({
    model: MODEL, messages: HELLO, max_tokens: 12, temperature: 1.0, seed, n,
  });
  const three = await ask(3, 7);
  assert.deepEqual(three.choices.map((c) => c.index), [0, 1, 2]);
  let completion = 0;
  for (let i = 0; i < 3; ++i) {
    const one = await ask(1, 7 + i);
    assert.equal(three.choices[i].message.content, one.choices[0].message.content, `choice ${i}`);
    assert.equal(three.usage.prompt_tokens, one.usage.prompt_tokens);
    completion += one.usage.completion_tokens;
  }
  assert.equal(three.usage.completion_tokens, completion);
  assert.equal(three.usage.total_tokens, three.usage.prompt_tokens + completion);
  const prompt = 'the cat is on the mat';
  const greedy = await openai.completions.create({ model: MODEL, prompt, max_tokens: 8, n: 2 });
  const want = cliRun(['--prompt', prompt, '-n', '8']);
  assert.deepEqual(greedy.choices.map((c) => [c.index, c.text]), [[0, want], [1, want]]);
  const bad = await post(main.base, '/v1/chat/completions', { messages: HELLO, n: 2, stream: true });
  assert.equal(bad.status, 400, bad.text);
  assert.equal(bad.json.error.param, 'n');
});

test('/tokenize and /detokenize: the ids of the CLI, pieces that add up to the text, a round trip, 400s', async () => {
  const text = 'hello world, caf\u00e9 \u{1F600}';
  const f = path.join(TMP, 'tok.jsonl');
  writeFileSync(f, JSON.stringify(text) + '\n');
  const cli = JSON.parse(execFileSync(BIN, ['tokenize', '--model', MODEL_DIR, '--input', f], { encoding: 'utf8' }));
  const t = await post(main.base, '/tokenize', { content: text });
  assert.equal(t.status, 200, t.text);
  assert.deepEqual(t.json.tokens, cli);
  const p = await post(main.base, '/tokenize', { content: text, with_pieces: true });
  assert.deepEqual(p.json.tokens.map((x) => x.id), cli);
  // Pieces are text, or byte values where a piece holds part of a character: together the text.
  const bytes = p.json.tokens.flatMap((x) =>
    typeof x.piece === 'string' ? [...Buffer.from(x.piece, 'utf8')] : x.piece);
  assert.equal(Buffer.from(bytes).toString('utf8'), text);
  const d = await post(main.base, '/detokenize', { tokens: cli });
  assert.equal(d.status, 200, d.text);
  assert.equal(d.json.content, text);
  for (const [route, body, param] of [['/tokenize', { text }, 'content'],
    ['/tokenize', { content: text, add_special: 'yes' }, 'add_special'],
    ['/detokenize', { tokens: [1, 512] }, 'tokens'], ['/detokenize', { tokens: 'x' }, 'tokens']]) {
    const r = await post(main.base, route, body);
    assert.equal(r.status, 400, r.text);
    assert.equal(r.json.error.param, param);
  }
});

test('anthropic count_tokens: the prompt tokens a Messages request prefills', async () => {
  const req = { model: MODEL, system: 'be brief', messages: [{ role: 'user', content: 'write a poem' }] };
  const counted = await anthropic.messages.countTokens(req);
  const made = await anthropic.messages.create({ ...req, max_tokens: 2 });
  assert.equal(counted.input_tokens, made.usage.input_tokens);
  const longer = await anthropic.messages.countTokens({
    ...req, messages: [...req.messages, { role: 'assistant', content: 'ok' }, { role: 'user', content: 'more' }],
  });
  assert.ok(longer.input_tokens > counted.input_tokens);
  const bad = await post(main.base, '/v1/messages/count_tokens', { model: MODEL });
  assert.equal(bad.status, 400, bad.text);
  assert.equal(bad.json.type, 'error');  // Anthropic's error shape, naming the field
  assert.match(bad.json.error.message, /'messages'/);
});

test('stop strings cut the reply (OpenAI and Anthropic)', async () => {
  const full = (await openai.chat.completions.create({ model: MODEL, messages: HELLO, max_tokens: N })).choices[0].message.content;
  // A two-character stop taken from the middle of the greedy reply.
  const chars = [...full];
  assert.ok(chars.length >= 6, `reply too short for this test: ${JSON.stringify(full)}`);
  const k = Math.floor(chars.length / 2);
  const stop = chars.slice(k, k + 2).join('');
  const want = full.slice(0, full.indexOf(stop));
  const r = await openai.chat.completions.create({ model: MODEL, messages: HELLO, max_tokens: N, stop: [stop] });
  assert.equal(r.choices[0].message.content, want);
  assert.equal(r.choices[0].finish_reason, 'stop');
  const m = await anthropic.messages.create({ model: MODEL, max_tokens: N, messages: HELLO, stop_sequences: [stop] });
  assert.equal(m.stop_reason, 'stop_sequence');
  assert.equal(m.stop_sequence, stop);
  assert.equal(m.content.map((b) => b.text).join(''), want);
});

test('anthropic: non-stream and stream', async () => {
  const want = cliRun(['--messages', messagesFile(HELLO), '-n', String(N)]);
  const m = await anthropic.messages.create({ model: MODEL, max_tokens: N, messages: HELLO });
  assert.equal(m.type, 'message');
  assert.equal(m.role, 'assistant');
  assert.equal(m.content.length, 1);
  assert.equal(m.content[0].type, 'text');
  assert.equal(m.content[0].text, want);
  assert.ok(['max_tokens', 'end_turn'].includes(m.stop_reason));
  assert.ok(m.usage.input_tokens > 5 && m.usage.output_tokens > 0);

  const events = [];
  const stream = anthropic.messages.stream({ model: MODEL, max_tokens: N, messages: HELLO });
  stream.on('streamEvent', (e) => events.push(e.type));
  const final = await stream.finalMessage();
  assert.equal(final.content[0].text, want);
  assert.deepEqual(final.usage, m.usage);
  assert.equal(final.stop_reason, m.stop_reason);
  assert.equal(events[0], 'message_start');
  assert.equal(events.at(-1), 'message_stop');
  assert.equal(events.at(-2), 'message_delta');
  assert.ok(events.includes('content_block_start') && events.includes('content_block_stop'));
});

test('errors: 4xx with a JSON body naming the field; the server keeps serving', async () => {
  const chat = (body) => post(main.base, '/v1/chat/completions', body);
  let r = await chat('{"messages": [');
  assert.equal(r.status, 400);
  assert.match(r.json.error.message, /not valid JSON/);
  assert.equal(r.json.error.type, 'invalid_request_error');

  const cases = [
    [{ messages: HELLO, temperature: 'hot' }, 400, 'temperature'],
    [{ messages: HELLO, max_tokens: 0 }, 400, 'max_tokens'],
    [{ messages: HELLO, max_tokens: -5 }, 400, 'max_tokens'],
    [{ messages: [] }, 400, 'messages'],
    [{ messages: 'hi' }, 400, 'messages'],
    [{ model: 'gpt-4o', messages: HELLO }, 404, 'model'],
    [{ messages: [{ role: 'user', content: 'word '.repeat(1500) }] }, 400, 'messages'],
    [{ messages: HELLO, max_tokens: 5000 }, 400, 'max_tokens'],
  ];
  for (const [body, status, param] of cases) {
    r = await chat(body);
    assert.equal(r.status, status, JSON.stringify(body).slice(0, 80));
    assert.equal(r.json.error.param, param);
    assert.ok(r.json.error.message.length > 0);
  }
  assert.equal((await chat({ model: 'gpt-4o', messages: HELLO })).json.error.code, 'model_not_found');
  assert.equal((await chat({ messages: [{ role: 'user', content: 'word '.repeat(1500) }] })).json.error.code,
    'context_length_exceeded');

  // Body over --max-body-bytes.
  r = await chat({ messages: [{ role: 'user', content: 'x'.repeat(100000) }] });
  assert.equal(r.status, 413);
  assert.match(r.json.error.message, /larger than 65536 bytes/);

  // Unknown route, completions and Anthropic shapes.
  r = await post(main.base, '/v1/nope', {});
  assert.equal(r.status, 404);
  assert.ok(r.json.error.message);
  r = await post(main.base, '/v1/completions', { prompt: 42 });
  assert.equal(r.status, 400);
  assert.equal(r.json.error.param, 'prompt');
  r = await post(main.base, '/v1/messages', { model: MODEL, messages: HELLO });
  assert.equal(r.status, 400);
  assert.equal(r.json.type, 'error');
  assert.equal(r.json.error.type, 'invalid_request_error');
  assert.match(r.json.error.message, /max_tokens/);

  // The clients surface them as typed errors.
  await assert.rejects(openai.chat.completions.create({ model: 'nope', messages: HELLO }),
    (e) => e.status === 404 && e.code === 'model_not_found');
  await assert.rejects(anthropic.messages.create({ model: MODEL, max_tokens: 0, messages: HELLO }),
    (e) => e.status === 400 && /max_tokens/.test(e.message));

  // Still serving, with the same greedy answer.
  const ok = await openai.chat.completions.create({ model: MODEL, messages: HELLO, max_tokens: N });
  assert.equal(ok.choices[0].message.content, cliRun(['--messages', messagesFile(HELLO), '-n', String(N)]));
});

test('tool calls and reasoning (fixed reply)', async () => {
  const reply = '<think>\nchecking the weather\n</think>\n\nLet me look.\n<tool_call>\n' +
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>';
  const s = await startServer([], { TURBOSPARK_SERVE_TEST_REPLY: reply });
  try {
    const client = new OpenAI({ baseURL: s.base + '/v1', apiKey: 'unused', maxRetries: 0 });
    const tools = [{
      type: 'function',
      function: { name: 'get_weather', description: 'Weather for a city',
                  parameters: { type: 'object', properties: { city: { type: 'string' } } } },
    }];
    const messages = [{ role: 'user', content: 'Weather in Paris?' }];
    const r = await client.chat.completions.create({ model: MODEL, messages, tools });
    const msg = r.choices[0].message;
    assert.equal(r.choices[0].finish_reason, 'tool_calls');
    assert.equal(msg.reasoning_content, 'checking the weather\n');
    assert.equal(msg.content, 'Let me look.\n');
    assert.equal(msg.tool_calls.length, 1);
    assert.equal(msg.tool_calls[0].type, 'function');
    assert.match(msg.tool_calls[0].id, /^call_/);
    assert.equal(msg.tool_calls[0].function.name, 'get_weather');
    assert.deepEqual(JSON.parse(msg.tool_calls[0].function.arguments), { city: 'Paris', unit: 'C' });

    // Streaming: the same call arrives as one tool_calls delta.
    const calls = [];
    let finish = null;
    let reasoning = '';
    for await (const c of await client.chat.completions.create({ model: MODEL, messages, tools, stream: true })) {
      const d = c.choices[0]?.delta ?? {};
      reasoning += d.reasoning_content ?? '';
      for (const tc of d.tool_calls ?? []) calls.push(tc);
      finish = c.choices[0]?.finish_reason ?? finish;
    }
    assert.equal(finish, 'tool_calls');
    assert.equal(reasoning, 'checking the weather\n');
    assert.equal(calls.length, 1);
    assert.equal(calls[0].index, 0);
    assert.deepEqual(JSON.parse(calls[0].function.arguments), { city: 'Paris', unit: 'C' });

    // Without tools in the request the same text is plain content.
    const plain = await client.chat.completions.create({ model: MODEL, messages });
    assert.equal(plain.choices[0].finish_reason, 'stop');
    assert.match(plain.choices[0].message.content, /^Let me look\.\n<tool_call>/);

    // The conversation goes on with the tool's answer.
    const next = await client.chat.completions.create({
      model: MODEL, tools,
      messages: [...messages, { role: 'assistant', content: null, tool_calls: msg.tool_calls },
                 { role: 'tool', tool_call_id: msg.tool_calls[0].id, content: '21 C' }],
    });
    assert.equal(next.choices[0].message.tool_calls.length, 1);

    // Anthropic: thinking, text and tool_use blocks.
    const ant = new Anthropic({ baseURL: s.base, apiKey: 'unused', maxRetries: 0 });
    const atools = [{ name: 'get_weather', description: 'Weather', input_schema: { type: 'object' } }];
    const m = await ant.messages.create({ model: MODEL, max_tokens: 200, messages, tools: atools });
    assert.equal(m.stop_reason, 'tool_use');
    assert.deepEqual(m.content.map((b) => b.type), ['thinking', 'text', 'tool_use']);
    assert.equal(m.content[0].thinking, 'checking the weather\n');
    assert.equal(m.content[2].name, 'get_weather');
    assert.deepEqual(m.content[2].input, { city: 'Paris', unit: 'C' });
    const streamed = await ant.messages.stream({ model: MODEL, max_tokens: 200, messages, tools: atools }).finalMessage();
    assert.deepEqual(streamed.content.map((b) => b.type), ['thinking', 'text', 'tool_use']);
    assert.deepEqual(streamed.content[2].input, { city: 'Paris', unit: 'C' });
    assert.equal(streamed.stop_reason, 'tool_use');
    // tool_result back in the next turn.
    const m2 = await ant.messages.create({
      model: MODEL, max_tokens: 200, tools: atools,
      messages: [...messages, { role: 'assistant', content: m.content.filter((b) => b.type !== 'thinking') },
                 { role: 'user', content: [{ type: 'tool_result', tool_use_id: m.content[2].id, content: '21 C' }] }],
    });
    assert.equal(m2.stop_reason, 'tool_use');
  } finally {
    await stopServer(s);
  }
});

test('auth and the queue limit', async () => {
  const s = await startServer(['--max-queue', '1'], { TURBOSPARK_API_KEY: 's3cret' });
  try {
    assert.equal((await fetch(s.base + '/health')).status, 200);
    let r = await fetch(s.base + '/v1/models');
    assert.equal(r.status, 401);
    assert.equal((await r.json()).error.code, 'invalid_api_key');
    r = await fetch(s.base + '/v1/models', { headers: { authorization: 'Bearer wrong' } });
    assert.equal(r.status, 401);
    r = await fetch(s.base + '/metrics', { headers: { authorization: 'Bearer s3cret' } });
    assert.equal(r.status, 200);
    r = await fetch(s.base + '/v1/models', { headers: { 'x-api-key': 's3cret' } });
    assert.equal(r.status, 200);
    const a = await post(s.base, '/v1/messages', { model: MODEL, max_tokens: 4, messages: HELLO });
    assert.equal(a.status, 401);
    assert.equal(a.json.error.type, 'authentication_error');
    await assert.rejects(new OpenAI({ baseURL: s.base + '/v1', apiKey: 'nope', maxRetries: 0 }).models.list(),
      (e) => e.status === 401);
    const client = new OpenAI({ baseURL: s.base + '/v1', apiKey: 's3cret', maxRetries: 0 });
    assert.equal((await client.models.list()).data[0].id, MODEL);
    const ant = new Anthropic({ baseURL: s.base, apiKey: 's3cret', maxRetries: 0 });
    assert.equal((await ant.messages.create({ model: MODEL, max_tokens: 4, messages: HELLO })).type, 'message');

    // One running + one waiting; the rest get 503 with a JSON error.
    const burst = await Promise.all(Array.from({ length: 8 }, () => post(s.base, '/v1/completions',
      { prompt: 'once upon a time', max_tokens: 900 }, { authorization: 'Bearer s3cret' })));
    const codes = burst.map((b) => b.status);
    assert.ok(codes.filter((c) => c === 503).length >= 1, `codes ${codes}`);
    assert.ok(codes.filter((c) => c === 200).length >= 2, `codes ${codes}`);
    for (const b of burst.filter((b) => b.status === 503)) assert.equal(b.json.error.code, 'queue_full');
    for (const b of burst.filter((b) => b.status === 200)) assert.equal(b.json.usage.completion_tokens, 900);
  } finally {
    await stopServer(s);
  }
});

test('warm-up: before the port opens, left out of /metrics; the same reply as without it', async () => {
  // A streamed expert cache of 4 slots: the warm-up's experts stay in it, so the first request
  // hits more often, but it asks the store for the same experts and gets the same reply.
  const flags = ['--residency', 'streamed', '--expert-cache-slots', '4'];
  const body = { model: MODEL, messages: HELLO, max_tokens: 6, temperature: 0 };
  const seen = [];
  for (const extra of [[], ['--no-warmup']]) {
    const s = await startServer([...flags, ...extra]);
    try {
      const r = await post(s.base, '/v1/chat/completions', body);
      assert.equal(r.status, 200);
      seen.push({
        log: s.log(),
        text: r.json.choices[0].message.content,
        tokens: await metric(s.base, 'turbospark_completion_tokens_total'),
        requests: await metric(s.base, 'turbospark_expert_requests_total'),
        hits: await metric(s.base, 'turbospark_expert_hits_total'),
      });
    } finally {
      await stopServer(s);
    }
  }
  const [warm, cold] = seen;
  assert.match(warm.log, /http:.*, warmed up in [\d.]+ s \(\d+ prompt tokens, 2 decode steps\)\)$/m);
  assert.match(cold.log, /http:.*, no warm-up\)$/m);
  assert.equal(warm.text, cold.text);
  assert.equal(warm.tokens, 6);
  assert.equal(cold.tokens, 6);
  assert.ok(cold.requests > 0);
  assert.equal(warm.requests, cold.requests);
  assert.ok(warm.hits <= warm.requests && cold.hits <= cold.requests);
});

test('load: 16 concurrent streaming clients x 50 requests, each reply complete and its own', async () => {
  const clients = 16, rounds = 50, maxTokens = 8;
  const prompt = (i) => [{ role: 'user', content: `client ${i} asks question ${i * 7}` }];
  // Single-client references, one request at a time.
  const want = [];
  for (let i = 0; i < clients; i++) {
    const r = await openai.chat.completions.create({ model: MODEL, messages: prompt(i), max_tokens: maxTokens });
    want.push(r.choices[0].message.content);
  }
  assert.ok(new Set(want).size > clients / 2, 'prompts should give different replies');
  const before = await metric(main.base, 'turbospark_generations_total');
  const t0 = Date.now();
  let done = 0;
  await Promise.all(Array.from({ length: clients }, async (_, i) => {
    const client = new OpenAI({ baseURL: main.base + '/v1', apiKey: 'unused', maxRetries: 0, timeout: 120000 });
    for (let k = 0; k < rounds; k++) {
      const stream = await client.chat.completions.create({
        model: MODEL, messages: prompt(i), max_tokens: maxTokens, stream: true, stream_options: { include_usage: true },
      });
      let text = '', finish = null, usage = null;
      for await (const c of stream) {
        if (c.usage) usage = c.usage;
        if (c.choices.length) {
          text += c.choices[0].delta.content ?? '';
          finish = c.choices[0].finish_reason ?? finish;
        }
      }
      assert.equal(text, want[i], `client ${i} round ${k}`);
      assert.ok(finish === 'length' || finish === 'stop', `client ${i} round ${k}: no finish chunk`);
      assert.ok(usage && usage.completion_tokens <= maxTokens, `client ${i} round ${k}: no usage`);
      done++;
    }
  }));
  const seconds = (Date.now() - t0) / 1000;
  assert.equal(done, clients * rounds);
  assert.equal(await metric(main.base, 'turbospark_generations_total') - before, clients * rounds);
  console.log(`# load: ${clients * rounds} streamed requests in ${seconds.toFixed(1)} s ` +
              `(${(clients * rounds / seconds).toFixed(0)} req/s)`);
});

// Continuous batching: every stream complete and equal to its request sent alone, with 64
// in flight at once; and with a KV pool too small for all of them, the others wait.
async function streamText(client, messages, maxTokens) {
  const stream = await client.chat.completions.create({
    model: MODEL, messages, max_tokens: maxTokens, stream: true, stream_options: { include_usage: true },
  });
  let text = '', finish = null, usage = null;
  for await (const c of stream) {
    if (c.usage) usage = c.usage;
    if (c.choices.length) {
      text += c.choices[0].delta.content ?? '';
      finish = c.choices[0].finish_reason ?? finish;
    }
  }
  return { text, finish, usage };
}

test('ollama: chat and generate, streamed or not, equal the CLI; list, show, version; errors', async () => {
  const ollama = new Ollama({ host: main.base });
  const options = { temperature: 0, num_predict: 8 };
  const want = cliRun(['--messages', messagesFile(HELLO), '-n', '8']);
  const chat = await ollama.chat({ model: MODEL, messages: HELLO, stream: false, options });
  assert.equal(chat.message.role, 'assistant');
  assert.equal(chat.message.content, want);
  assert.equal(chat.done, true);
  assert.ok(['stop', 'length'].includes(chat.done_reason));
  assert.ok(chat.eval_count <= 8 && chat.prompt_eval_count > 0 && chat.eval_duration > 0);
  let streamed = '', last = null;
  for await (const part of await ollama.chat({ model: MODEL, messages: HELLO, stream: true, options })) {
    streamed += part.message.content;
    last = part;
  }
  assert.equal(streamed, want);
  assert.equal(last.done, true);
  assert.equal(last.eval_count, chat.eval_count);
  // generate: raw is the prompt as it is (as `run --prompt`), else a user turn of the template.
  const prompt = 'the cat is on the mat';
  const raw = await ollama.generate({ model: `${MODEL}:latest`, prompt, raw: true, stream: false, options });
  assert.equal(raw.response, cliRun(['--prompt', prompt, '-n', '8']));
  const turn = await ollama.generate({ model: MODEL, prompt: 'Hello!', stream: false, options });
  const userTurn = [{ role: 'user', content: 'Hello!' }];
  assert.equal(turn.response, cliRun(['--messages', messagesFile(userTurn), '-n', '8']));
  // format json: the reply is one JSON object.
  const js = await ollama.chat({ model: MODEL, messages: HELLO, format: 'json', stream: false, options: { temperature: 0, num_predict: 64 } });
  if (js.done_reason === 'stop') assert.equal(typeof JSON.parse(js.message.content), 'object');
  const tags = await ollama.list();
  assert.equal(tags.models.length, 1);
  assert.equal(tags.models[0].name, MODEL);
  assert.equal(tags.models[0].details.family, 'qwen3_moe');
  const show = await ollama.show({ model: MODEL });
  assert.equal(show.model_info['general.architecture'], 'qwen3_moe');
  assert.ok(show.template.length > 0);
  assert.ok((await ollama.version()).version);
  await assert.rejects(ollama.chat({ model: 'nope', messages: HELLO, stream: false }),
    (e) => e.status_code === 404 && /nope/.test(e.error));
  await assert.rejects(ollama.chat({ model: MODEL, messages: [{ role: 'user', content: 'x', images: ['aGk='] }], stream: false }),
    (e) => e.status_code === 400 && /images/.test(e.error));
  const r = await fetch(main.base + '/api/generate', { method: 'POST', body: JSON.stringify({ model: MODEL, prompt: 'x', suffix: 'y' }) });
  assert.equal(r.status, 400);
  assert.match((await r.json()).error, /suffix/);
});

test('prefix cache: a chat that goes on shares the earlier request\'s KV blocks; the reply is the one without them', async () => {
  const first = [{ role: 'user', content: 'Tell me about the sea, the wind, the ships and the long grey harbour walls.' }];
  const r1 = await openai.chat.completions.create({ model: MODEL, messages: first, max_tokens: 12 });
  const hits0 = await metric(main.base, 'turbospark_kv_prefix_hit_tokens_total');
  const more = [...first, { role: 'assistant', content: r1.choices[0].message.content },
    { role: 'user', content: 'And the lighthouse?' }];
  const r2 = await openai.chat.completions.create({ model: MODEL, messages: more, max_tokens: 12 });
  const hits = (await metric(main.base, 'turbospark_kv_prefix_hit_tokens_total')) - hits0;
  assert.ok(hits >= 16 && hits % 16 === 0, `prefix hits ${hits}`);
  assert.ok(hits < r2.usage.prompt_tokens);
  assert.equal(r2.choices[0].message.content, cliRun(['--messages', messagesFile(more), '-n', '12']));
  assert.ok(await metric(main.base, 'turbospark_kv_blocks') > 0);
});

for (const [what, args, clients, maxTokens] of [
  ['64 streams x 128 tokens, --parallel 64', ['--parallel', '64'], 64, 128],
  ['12 streams, a KV pool for 3 (--kv-tokens 1024): the rest wait', ['--parallel', '12', '--kv-tokens', '1024'], 12, 300],
]) {
  test(`batching: ${what}; each stream complete and its own`, async () => {
    const srv = await startServer(args);
    try {
      const client = new OpenAI({ baseURL: srv.base + '/v1', apiKey: 'unused', maxRetries: 0, timeout: 300000 });
      const prompt = (i) => [{ role: 'user', content: `batch client ${i}: ${'word '.repeat(i % 9)}?` }];
      const want = [];
      for (let i = 0; i < clients; i++) want.push((await streamText(client, prompt(i), maxTokens)).text);
      assert.ok(new Set(want).size > clients / 2, 'prompts should give different replies');
      const t0 = Date.now();
      const got = await Promise.all(Array.from({ length: clients }, (_, i) => streamText(client, prompt(i), maxTokens)));
      const seconds = (Date.now() - t0) / 1000;
      got.forEach((g, i) => {
        assert.equal(g.text, want[i], `client ${i}`);
        assert.ok(g.finish === 'length' || g.finish === 'stop', `client ${i}: no finish chunk`);
        assert.ok(g.usage && g.usage.completion_tokens <= maxTokens, `client ${i}: no usage`);
      });
      const tokens = got.reduce((n, g) => n + g.usage.completion_tokens, 0);
      console.log(`# batching (${what}): ${tokens} tokens in ${seconds.toFixed(2)} s`);
      assert.equal(await metric(srv.base, 'turbospark_generation_failures_total'), 0);
    } finally {
      await stopServer(srv);
    }
  });
}

test('clients that disconnect mid-stream cancel their generation; the server stays healthy', async () => {
  const cancelledBefore = await metric(main.base, 'turbospark_generations_cancelled_total');
  const drops = 6;
  await Promise.all(Array.from({ length: drops }, async (_, i) => {
    const controller = new AbortController();
    const stream = await openai.chat.completions.create(
      { model: MODEL, messages: [{ role: 'user', content: `long story ${i}` }], max_tokens: 900, stream: true },
      { signal: controller.signal });
    let chunks = 0;
    try {
      for await (const c of stream) {
        if (++chunks === 3) controller.abort();
      }
    } catch (e) {
      assert.ok(e.name === 'AbortError' || /abort/i.test(String(e)), String(e));
    }
  }));
  // Each dropped stream is cancelled at its next token; wait for the engine to get there.
  let cancelled = 0;
  for (let t = 0; t < 100; t++) {
    cancelled = await metric(main.base, 'turbospark_generations_cancelled_total') - cancelledBefore;
    if (cancelled >= drops && await metric(main.base, 'turbospark_queue_depth') === 0) break;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.ok(cancelled >= 1, `no generation was cancelled (${cancelled})`);
  console.log(`# disconnects: ${cancelled} of ${drops} generations cancelled`);
  assert.equal((await fetch(main.base + '/health')).status, 200);
  const r = await openai.chat.completions.create({ model: MODEL, messages: HELLO, max_tokens: N });
  assert.equal(r.choices[0].message.content, cliRun(['--messages', messagesFile(HELLO), '-n', String(N)]));
});
