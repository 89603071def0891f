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

async function stopServer(s) {
  if (!s || s.proc.exitCode !== null) return;
  const exited = new Promise((r) => s.proc.on('exit', r));
  s.proc.kill('SIGTERM');
  await exited;
}

async function post(base, route, body, headers = {}) {
  const res = await fetch(base + route, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: typeof body === 'string' ? body : JSON.stringify(body),
  });
  const text = await res.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* checked by callers */ }
  return { status: res.status, json, text, headers: res.headers };
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

before(async () => { main = await startServer(['--max-body-bytes', String(MAX_BODY)]); });
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
