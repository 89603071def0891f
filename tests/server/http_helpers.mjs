// What the server test files share: stopping a `turbospark serve` child, and a POST whose
// reply is read whole (status, parsed JSON when it is JSON, text, headers).

export async function stopServer(s) {
  if (!s || s.proc.exitCode !== null) return;
  const exited = new Promise((r) => s.proc.on('exit', r));
  s.proc.kill('SIGTERM');
  await exited;
}

export async function post(base, route, body, headers = {}) {
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
