// `turbospark serve` against hostile clients (issue 56): each test sends what an attacker
// would, checks the refusal, and the server must then still answer /health and a normal
// request. Raw sockets (node:net) where fetch would normalise the bytes away.
//
// Usage: TURBOSPARK_BIN=build/turbospark node tests/server/abuse.test.mjs
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import net from 'node:net';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { post, stopServer } from './http_helpers.mjs';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const BIN = process.env.TURBOSPARK_BIN ?? path.join(ROOT, 'build/turbospark');
const MODEL_DIR = path.join(ROOT, 'tests/models/qwen3_moe');

// Starts `turbospark serve` on a free port (or `port`); resolves once it listens.
function startServer(args = [], port = 0) {
  const proc = spawn(BIN, ['serve', '--model', MODEL_DIR, '--port', String(port), '--no-warmup', ...args], {
    env: { ...process.env, TURBOSPARK_API_KEY: '' },
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  let log = '';
  return new Promise((resolve, reject) => {
    proc.stderr.on('data', (d) => {
      log += d;
      const m = log.match(/http:\/\/127\.0\.0\.1:(\d+)/);
      if (m && !proc.port) {
        proc.port = Number(m[1]);
        resolve({ proc, port: proc.port, base: `http://127.0.0.1:${proc.port}`, log: () => log });
      }
    });
    proc.on('exit', (code) => reject(new Error(`serve exited with ${code}: ${log}`)));
  });
}

// Sends raw bytes (a string or a list of pieces written one after another) and resolves with
// everything the server wrote before it closed, or what came within `ms`.
function raw(port, pieces, { ms = 5000, pauseMs = 0 } = {}) {
  return new Promise((resolve, reject) => {
    const sock = net.connect(port, '127.0.0.1');
    let out = '';
    const timer = setTimeout(() => { sock.destroy(); resolve(out); }, ms);
    sock.on('data', (d) => { out += d; });
    sock.on('error', (e) => { clearTimeout(timer); if (out) resolve(out); else reject(e); });
    sock.on('close', () => { clearTimeout(timer); resolve(out); });
    sock.on('connect', async () => {
      for (const p of Array.isArray(pieces) ? pieces : [pieces]) {
        if (sock.destroyed) break;
        sock.write(p);
        if (pauseMs) await new Promise((r) => setTimeout(r, pauseMs));
      }
    });
  });
}

const statusOf = (response) => Number((response.match(/^HTTP\/1\.[01] (\d{3})/) ?? [])[1]);

let main;
const MAX_BODY = 1 << 20;
const HELLO = { messages: [{ role: 'user', content: 'hi' }], max_tokens: 2, temperature: 0 };

// The server is alive and answers correctly.
async function healthy(s = main) {
  const h = await fetch(s.base + '/health');
  assert.equal(h.status, 200);
  const r = await post(s.base, '/v1/chat/completions', HELLO);
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.object, 'chat.completion');
}

before(async () => { main = await startServer(['--max-body-bytes', String(MAX_BODY), '--request-timeout-s', '3']); });
after(async () => { await stopServer(main); });

test('deeply nested JSON in any field is a 400 naming the limit, not a crash', async () => {
  const deep = (n) => '['.repeat(n) + ']'.repeat(n);
  const D = 100000;
  const bodies = [
    ['/detokenize', `{"tokens": ${deep(D)}}`],
    ['/tokenize', `{"content": "x", "extra": ${deep(D)}}`],
    ['/v1/chat/completions', `{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": ${deep(D)}}}`],
    ['/v1/chat/completions', `{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": ${deep(D)}}}`],
    ['/v1/chat/completions', `{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": ${deep(D)}}}]}`],
    ['/v1/messages', `{"max_tokens": 1, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": ${deep(D)}}]}]}`],
    ['/v1/messages', `{"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f", "input_schema": ${deep(D)}}]}`],
    ['/v1/messages/count_tokens', `{"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f", "input_schema": ${deep(D)}}]}`],
    // Objects as well as arrays, and with text/plain (which browsers send cross-site unasked).
    ['/v1/completions', '{"prompt": "x", "a": ' + '{"k":'.repeat(D) + '1' + '}'.repeat(D) + '}'],
  ];
  for (const [route, body] of bodies) {
    const r = await post(main.base, route, body, { 'content-type': 'text/plain' });
    assert.equal(r.status, 400, `${route}: ${r.text.slice(0, 200)}`);
    assert.match(r.json.error.message, /deeper than 128 levels/, route);
  }
  // Just inside the limit is parsed as usual (and then refused for what it is).
  const ok = await post(main.base, '/detokenize', `{"tokens": ${deep(127)}}`);
  assert.equal(ok.status, 400);
  assert.match(ok.json.error.message, /'tokens\[0\]'/);
  await healthy();
});

test('--max-body-bytes holds for chunked and compressed bodies', async () => {
  // Chunked: counted as it is decoded; 2 MiB at a 1 MiB limit is refused, a small one served.
  const chunk = 'x'.repeat(64 << 10);
  const pieces = ['POST /detokenize HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n'];
  for (let i = 0; i < 32; i++) pieces.push(`${chunk.length.toString(16)}\r\n${chunk}\r\n`);
  pieces.push('0\r\n\r\n');
  let r = await raw(main.port, pieces);
  assert.equal(statusOf(r), 413, r.slice(0, 300));
  assert.match(r, /larger than 1048576 bytes \(--max-body-bytes\)/);
  r = await raw(main.port, 'POST /detokenize HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n' +
    'Connection: close\r\n\r\n5\r\n{"tok\r\n9;ext=1\r\nens":[1]}\r\n0\r\n\r\n');
  assert.equal(statusOf(r), 200, r);
  assert.match(r, /"content"/);
  // Malformed framing: a 400 / 501 naming it, never a guess at where the body ends.
  for (const [te, body, status, message] of [
    ['chunked', 'zz\r\nab\r\n0\r\n\r\n', 400, /chunk size is not a hexadecimal number/],
    ['chunked', '2\r\nabX\r\n0\r\n\r\n', 400, /chunk data is not followed by CRLF/],
    ['gzip, chunked', '', 501, /Transfer-Encoding 'gzip, chunked' is not supported/],
  ]) {
    r = await raw(main.port, `POST /detokenize HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: ${te}\r\n\r\n${body}`);
    assert.equal(statusOf(r), status, r);
    assert.match(r, message);
  }
  // Expect: 100-continue (curl sends it for large bodies): the 100 once the head passed.
  const one = JSON.stringify({ tokens: [1] });
  r = await raw(main.port, [`POST /detokenize HTTP/1.1\r\nHost: localhost\r\nExpect: 100-continue\r\n` +
    `Content-Length: ${one.length}\r\nConnection: close\r\n\r\n`, one], { pauseMs: 300 });
  assert.match(r, /^HTTP\/1\.1 100 Continue\r\n\r\nHTTP\/1\.1 200 OK\r\n/, r);
  // A declared length over the limit is refused before the body is sent.
  r = await raw(main.port, `POST /detokenize HTTP/1.1\r\nHost: localhost\r\nContent-Length: ${MAX_BODY + 1}\r\n\r\n`, { ms: 2000 });
  assert.equal(statusOf(r), 413, r);
  // gzip would expand past any limit after it is checked: refused whatever its size.
  const { gzipSync } = await import('node:zlib');
  const res = await fetch(main.base + '/detokenize', {
    method: 'POST', headers: { 'content-type': 'application/json', 'content-encoding': 'gzip' },
    body: gzipSync(JSON.stringify({ tokens: [1] })),
  });
  assert.equal(res.status, 415);
  assert.match((await res.json()).error.message, /Content-Encoding 'gzip' is not accepted/);
  await healthy();
});

test('header count and size are bounded before the API key is checked', async () => {
  const keyed = await startServer(['--api-key', 's3cret']);
  try {
    const many = 'GET /v1/models HTTP/1.1\r\nHost: localhost\r\n' +
      Array.from({ length: 1000 }, (_, i) => `X-H${i}: v\r\n`).join('') + '\r\n';
    let r = await raw(keyed.port, many);
    assert.equal(statusOf(r), 431, r.slice(0, 300));
    assert.match(r, /more than 100 header fields/);
    const long = `GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Big: ${'a'.repeat(70000)}\r\n\r\n`;
    r = await raw(keyed.port, long);
    assert.equal(statusOf(r), 431, r.slice(0, 300));
    assert.match(r, /longer than 65536 bytes/);
    // Refused by the connection layer, and still counted.
    const metrics = await (await fetch(keyed.base + '/metrics', { headers: { authorization: 'Bearer s3cret' } })).text();
    assert.match(metrics, /^turbospark_http_responses_total\{route="\/v1\/models",status="431"\} 2$/m);
    // (Under the limits, the key decides.)
    r = await raw(keyed.port, 'GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n');
    assert.equal(statusOf(r), 401);
    // RFC 7235: the scheme is case-insensitive.
    for (const scheme of ['Bearer', 'bearer', 'BEARER']) {
      const m = await fetch(keyed.base + '/v1/models', { headers: { authorization: `${scheme} s3cret` } });
      assert.equal(m.status, 200, scheme);
    }
  } finally {
    await stopServer(keyed);
  }
});

test('slow clients: /health answers while 200 connections trickle headers; each is cut off with a 408', async () => {
  const socks = [];
  for (let i = 0; i < 200; i++) {
    const s = net.connect(main.port, '127.0.0.1');
    s.on('error', () => {});
    s.write('GET /health HTTP/1.1\r\n');
    socks.push(s);
  }
  let stop = false;
  const trickle = (async () => {
    for (let i = 0; !stop; i++) {
      for (const s of socks) if (!s.destroyed) s.write(`X-${i}: a\r\n`);
      await new Promise((r) => setTimeout(r, 200));
    }
  })();
  try {
    await new Promise((r) => setTimeout(r, 500));
    const t0 = Date.now();
    await healthy();
    assert.ok(Date.now() - t0 < 2000, `healthy took ${Date.now() - t0} ms`);
    // Each trickling request is cut off at --request-timeout-s 3 with a 408.
    const late = await raw(main.port, ['POST /detokenize HTTP/1.1\r\n', 'Host: localhost\r\n', 'X-A: 1\r\n',
      'X-B: 1\r\n', 'X-C: 1\r\n', 'X-D: 1\r\n', 'X-E: 1\r\n', 'X-F: 1\r\n', 'X-G: 1\r\n'], { ms: 8000, pauseMs: 600 });
    assert.equal(statusOf(late), 408, late);
    assert.match(late, /within 3 s \(--request-timeout-s\)/);
  } finally {
    stop = true;
    await trickle;
    for (const s of socks) s.destroy();
  }
});

test('listen backlog 512, and a second server on the same port fails (no SO_REUSEPORT)', async () => {
  const { execFileSync } = await import('node:child_process');
  const ss = execFileSync('ss', ['-Hltn', `sport = :${main.port}`], { encoding: 'utf8' });
  // For a listening socket, ss shows the backlog as Send-Q.
  assert.equal(Number(ss.trim().split(/\s+/)[2]), 512, ss);
  const second = spawn(BIN, ['serve', '--model', MODEL_DIR, '--port', String(main.port), '--no-warmup'],
    { stdio: ['ignore', 'ignore', 'pipe'] });
  let log = '';
  second.stderr.on('data', (d) => { log += d; });
  const code = await new Promise((r) => second.on('exit', r));
  assert.equal(code, 2, log);
  assert.match(log, new RegExp(`cannot bind 127\\.0\\.0\\.1:${main.port}`));
  await healthy();
});

test('a non-streaming request stops generating when its client disconnects', async () => {
  const before = await (await fetch(main.base + '/metrics')).text();
  const count = (text) => Number(text.match(/^turbospark_generations_cancelled_total (\S+)$/m)[1]);
  const body = JSON.stringify({ prompt: 'once upon a time', max_tokens: 1000, temperature: 0 });
  await raw(main.port, `POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n` +
    `Content-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`, { ms: 30 });
  let cancelled = 0;
  for (let i = 0; i < 40 && cancelled === 0; i++) {
    await new Promise((r) => setTimeout(r, 100));
    cancelled = count(await (await fetch(main.base + '/metrics')).text()) - count(before);
  }
  assert.equal(cancelled, 1);
  await healthy();
});

test('HTTP framing: HTTP/1.0 streams without chunks, pipelining, conflicting Content-Length', async () => {
  const body = JSON.stringify({ ...HELLO, stream: true });
  let r = await raw(main.port, `POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n` +
    `Content-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`, { ms: 10000 });
  assert.equal(statusOf(r), 200, r);
  const [head, rest] = [r.slice(0, r.indexOf('\r\n\r\n')), r.slice(r.indexOf('\r\n\r\n') + 4)];
  assert.doesNotMatch(head, /transfer-encoding/i);
  assert.match(head, /^Connection: close$/mi);
  assert.ok(rest.startsWith('data: {'), rest.slice(0, 100));
  assert.ok(rest.endsWith('data: [DONE]\n\n'), rest.slice(-100));
  // Two requests in one write: two responses, in order.
  const one = JSON.stringify({ tokens: [1] });
  r = await raw(main.port, `POST /detokenize HTTP/1.1\r\nHost: localhost\r\nContent-Length: ${one.length}\r\n\r\n${one}` +
    'GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n');
  assert.equal((r.match(/HTTP\/1\.1 200 OK\r\n/g) ?? []).length, 2, r);
  assert.ok(r.indexOf('"content"') < r.indexOf('"status":"ok"'), r);
  r = await raw(main.port, 'POST /detokenize HTTP/1.1\r\nHost: localhost\r\nContent-Length: 13\r\n' +
    `Content-Length: 14\r\n\r\n${one}`);
  assert.equal(statusOf(r), 400, r);
  assert.match(r, /conflicting Content-Length headers \(13 and 14\)/);
  r = await raw(main.port, 'POST /detokenize HTTP/1.1\r\nHost: localhost\r\nContent-Length: 14\r\n' +
    `Transfer-Encoding: chunked\r\n\r\n${one}`);
  assert.equal(statusOf(r), 400, r);
  await healthy();
});

test('a prompt longer than the context can hold is refused before it is tokenized', async () => {
  const r = await post(main.base, '/v1/completions', { prompt: 'once upon a time '.repeat(50000), max_tokens: 1 });
  assert.equal(r.status, 400, r.text.slice(0, 300));
  assert.equal(r.json.error.code, 'context_length_exceeded');
  assert.match(r.json.error.message, /^the prompt is 850000 bytes: more than the context's 1024 tokens \(--n-ctx\)/);
  const chat = await post(main.base, '/v1/chat/completions', { messages: [{ role: 'user', content: 'x'.repeat(900000) }] });
  assert.equal(chat.status, 400);
  assert.match(chat.json.error.message, /bytes: more than the context's 1024 tokens/);
  await healthy();
});

test('tool_choice "required" or naming a function is refused, not ignored', async () => {
  const tools = [{ type: 'function', function: { name: 'f', parameters: { type: 'object' } } }];
  for (const tool_choice of ['required', { type: 'function', function: { name: 'f' } }]) {
    const r = await post(main.base, '/v1/chat/completions', { ...HELLO, tools, tool_choice });
    assert.equal(r.status, 400, r.text);
    assert.equal(r.json.error.param, 'tool_choice');
    assert.match(r.json.error.message, /not supported yet/);
  }
  for (const tool_choice of [{ type: 'any' }, { type: 'tool', name: 'f' }]) {
    const r = await post(main.base, '/v1/messages', {
      max_tokens: 2, messages: [{ role: 'user', content: 'hi' }], tools: [{ name: 'f', input_schema: { type: 'object' } }], tool_choice,
    });
    assert.equal(r.status, 400, r.text);
    assert.match(r.json.error.message, /not supported yet/);
  }
  assert.equal((await post(main.base, '/v1/chat/completions', { ...HELLO, tools, tool_choice: 'auto' })).status, 200);
});

test('a keyless loopback server: Host names checked (DNS rebinding), cross-site origins refused', async () => {
  let r = await raw(main.port, 'GET /v1/models HTTP/1.1\r\nHost: evil.example:8080\r\nConnection: close\r\n\r\n');
  assert.equal(statusOf(r), 403, r);
  assert.match(r, /Host 'evil\.example' is not a loopback name/);
  for (const host of [`localhost:${main.port}`, `127.0.0.1:${main.port}`, `[::1]:${main.port}`]) {
    r = await raw(main.port, `GET /v1/models HTTP/1.1\r\nHost: ${host}\r\nConnection: close\r\n\r\n`);
    assert.equal(statusOf(r), 200, host);
  }
  // A page elsewhere POSTing text/plain needs no preflight: the Origin header refuses it.
  const x = await post(main.base, '/v1/chat/completions', HELLO, { 'content-type': 'text/plain', origin: 'https://evil.example' });
  assert.equal(x.status, 403);
  assert.match(x.json.error.message, /--cors-origin/);
  const cors = await startServer(['--cors-origin', 'https://ui.example']);
  try {
    const pre = await fetch(cors.base + '/v1/chat/completions', {
      method: 'OPTIONS',
      headers: { origin: 'https://ui.example', 'access-control-request-method': 'POST', 'access-control-request-headers': 'content-type' },
    });
    assert.equal(pre.status, 204);
    assert.equal(pre.headers.get('access-control-allow-origin'), 'https://ui.example');
    const ok = await post(cors.base, '/v1/chat/completions', HELLO, { origin: 'https://ui.example' });
    assert.equal(ok.status, 200);
    assert.equal(ok.headers.get('access-control-allow-origin'), 'https://ui.example');
    assert.equal((await post(cors.base, '/v1/chat/completions', HELLO, { origin: 'https://other.example' })).status, 403);
  } finally {
    await stopServer(cors);
  }
});

test('connections over the open-file limit get a 503 with Retry-After, then service resumes', async () => {
  // A soft limit of 128 files: at most 64 connections (the limit less 64 for the model's files).
  const proc = spawn('bash', ['-c', `ulimit -n 128 && exec "$0" "$@"`, BIN, 'serve', '--model', MODEL_DIR,
    '--port', '0', '--no-warmup'], { env: { ...process.env, TURBOSPARK_API_KEY: '' }, stdio: ['ignore', 'ignore', 'pipe'] });
  let log = '';
  const port = await new Promise((resolve, reject) => {
    proc.stderr.on('data', (d) => { log += d; const m = log.match(/:(\d+) \(n_ctx/); if (m) resolve(Number(m[1])); });
    proc.on('exit', (code) => reject(new Error(`serve exited with ${code}: ${log}`)));
  });
  const s = { proc, port, base: `http://127.0.0.1:${port}` };
  const socks = [];
  try {
    for (let i = 0; i < 100; i++) {
      const sock = net.connect(port, '127.0.0.1');
      sock.on('error', () => {});
      sock.data = '';
      sock.on('data', (d) => { sock.data += d; });
      socks.push(sock);
    }
    await new Promise((r) => setTimeout(r, 1000));
    const busy = socks.filter((k) => k.data.startsWith('HTTP/1.1 503'));
    assert.ok(busy.length >= 30, `${busy.length} of 100 got a 503`);
    for (const k of busy) assert.match(k.data, /^Retry-After: 1\r$/m);
    for (const k of socks) k.destroy();
    await new Promise((r) => setTimeout(r, 300));
    await healthy(s);
  } finally {
    for (const k of socks) k.destroy();
    await stopServer(s);
  }
});

test('503 queue_full carries Retry-After', async () => {
  const s = await startServer(['--max-queue', '1']);
  try {
    const burst = await Promise.all(Array.from({ length: 6 }, () =>
      post(s.base, '/v1/completions', { prompt: 'once upon a time', max_tokens: 300 })));
    const busy = burst.filter((b) => b.status === 503);
    assert.ok(busy.length >= 1, `codes ${burst.map((b) => b.status)}`);
    for (const b of busy) assert.equal(b.headers.get('retry-after'), '1');
  } finally {
    await stopServer(s);
  }
});
