// The page (GET /) in a real headless Chromium from Debian, driven over the DevTools protocol: it submits a prompt on
// the server, its progress advances, a chunk's preview changes in place before the chunk's frames arrive, the video
// plays before the job has finished, and screenshots are kept (preview.png while a preview shows, page.png).
// Started by tests/test_http.cpp:
//   SKYREELS_PAGE_URL='http://127.0.0.1:PORT/#prompt=...&autostart' SKYREELS_OUT=DIR \
//     node page_in_chromium.mjs
// The DevTools socket is the `ws` package (pinned in package-lock.json), so Node.js 18 (Debian 12's) runs this; Node's
// own WebSocket needs 20.10 with --experimental-websocket, or 22.
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import WebSocket from 'ws';

const url = process.env.SKYREELS_PAGE_URL;
const out = process.env.SKYREELS_OUT;
const profile = mkdtempSync(join(tmpdir(), 'skyreels-chromium-'));
const browser = spawn('chromium', [
  '--headless=new', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--no-first-run',
  '--autoplay-policy=no-user-gesture-required', '--remote-debugging-port=0', `--user-data-dir=${profile}`,
  '--window-size=1000,1100', 'about:blank',
], { stdio: ['ignore', 'ignore', 'pipe'], detached: true });
let browserLog = '';
browser.stderr.on('data', (d) => { browserLog += d; });
const stop = () => {
  try { process.kill(-browser.pid, 'SIGKILL'); } catch (e) { /* gone already */ }
  rmSync(profile, { recursive: true, force: true });
};
process.on('exit', stop);
for (const signal of ['SIGTERM', 'SIGINT']) process.on(signal, () => process.exit(1));  // `timeout` stops us: Chromium goes too
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function devtools() {
  const file = join(profile, 'DevToolsActivePort');
  for (let i = 0; i < 300 && !existsSync(file); i++) await sleep(100);
  assert.ok(existsSync(file), `chromium did not start:\n${browserLog}`);
  const port = readFileSync(file, 'utf8').split('\n')[0];
  for (let i = 0; i < 100; i++) {
    const pages = (await (await fetch(`http://127.0.0.1:${port}/json/list`)).json()).filter((t) => t.type === 'page');
    if (pages.length) return pages[0].webSocketDebuggerUrl;
    await sleep(100);
  }
  assert.fail('no page target');
}

const socket = new WebSocket(await devtools(), { perMessageDeflate: false });
await new Promise((resolve, reject) => { socket.onopen = resolve; socket.onerror = reject; });
let nextId = 0;
const pending = new Map();
socket.onmessage = (m) => {
  const message = JSON.parse(m.data);
  if (message.id && pending.has(message.id)) {
    pending.get(message.id)(message);
    pending.delete(message.id);
  }
};
function send(method, params = {}) {
  const id = ++nextId;
  socket.send(JSON.stringify({ id, method, params }));
  return new Promise((resolve) => pending.set(id, resolve));
}
async function page() {
  const r = await send('Runtime.evaluate', { expression: 'JSON.stringify(window.__skyreels || null)', returnByValue: true });
  return JSON.parse(r.result.result.value);
}

await send('Page.enable');
await send('Page.navigate', { url });
const progress = new Set();
let state = null;
let shot = false;
let previewShot = false;
const until = Date.now() + 150000;
while (Date.now() < until) {
  await sleep(200);
  state = await page();
  if (!state) continue;
  if (!state.finished) progress.add(state.progress);
  if (!previewShot && state.previewShowing && state.previewsShown >= 2) {  // a preview animating, not the first one
    const image = await send('Page.captureScreenshot', { format: 'png' });
    writeFileSync(`${out}/preview.png`, Buffer.from(image.result.data, 'base64'));
    previewShot = true;
  }
  if (!shot && state.playedBeforeDone) {  // the video is playing while the job still runs
    const image = await send('Page.captureScreenshot', { format: 'png' });
    writeFileSync(`${out}/page.png`, Buffer.from(image.result.data, 'base64'));
    shot = true;
  }
  if (state.finished || state.error) break;
}
console.log('page state:', JSON.stringify(state), 'progress seen:', [...progress].join(','));
assert.ok(state, 'the page never ran its script');
assert.equal(state.error, null);
assert.equal(state.state, 'JOB_STATE_SUCCEEDED');
assert.ok([...progress].filter((p) => p > 0 && p < 100).length >= 2, 'progress did not advance step by step');
assert.ok(state.playedBeforeDone, 'the video did not play before the job finished');
assert.equal(state.chunksAppended, state.chunksFinished);
assert.ok(shot, 'no screenshot');
assert.ok(state.previewChangesBeforeFrames >= 2, 'no chunk showed a preview that changed twice before its frames');
assert.ok(previewShot, 'no screenshot of a preview');
socket.close();
console.log('page in chromium: all checks passed');
process.exit(0);
