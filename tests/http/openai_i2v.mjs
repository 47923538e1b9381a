// Image to video through the official `openai` npm package on a server whose model is an I2V checkpoint: one
// videos.create with input_reference (an uploaded PNG of any size; the pipeline resizes it). Started by
// tests/test_server_i2v.cpp, which compares the video's latents with `skyreels generate --pipeline i2v`:
//   SKYREELS_HTTP_URL=http://127.0.0.1:PORT SKYREELS_OUT=DIR SKYREELS_IMAGE=PNG SKYREELS_PROMPT=TEXT node openai_i2v.mjs
// Writes DIR/id.txt (the video's id) and DIR/i2v.mp4 (its content).
import assert from 'node:assert/strict';
import { File } from 'node:buffer';
import { readFileSync, writeFileSync } from 'node:fs';
import OpenAI, { toFile } from 'openai';

globalThis.File ??= File;  // Node.js 18 (Debian 12's) has `File` in node:buffer only

const out = process.env.SKYREELS_OUT;
const client = new OpenAI({
  apiKey: 'unused', baseURL: `${process.env.SKYREELS_HTTP_URL}/v1`, maxRetries: 0, timeout: 60000,
});

// 32x16, 1 s at 8 fps = 9 frames, 3 steps, flow_shift 5, seed 3402 (the test's `skyreels generate` flags); no
// guidance_scale: the i2v pipeline's default.
const created = await client.videos.create({
  prompt: process.env.SKYREELS_PROMPT, size: '32x16', seconds: '1', fps: 8, num_inference_steps: 3, flow_shift: 5,
  seed: 3402, input_reference: await toFile(readFileSync(process.env.SKYREELS_IMAGE), 'first.png', { type: 'image/png' }),
});
const until = Date.now() + 150000;
let video = created;
while (video.status !== 'completed' && video.status !== 'failed') {
  assert.ok(Date.now() < until, `video ${video.id} still ${video.status}`);
  await new Promise((r) => setTimeout(r, 100));
  video = await client.videos.retrieve(created.id);
}
assert.equal(video.status, 'completed', JSON.stringify(video.error));
writeFileSync(`${out}/i2v.mp4`, Buffer.from(await (await client.videos.downloadContent(video.id)).arrayBuffer()));
writeFileSync(`${out}/id.txt`, video.id);
console.log(`i2v video ${video.id} completed`);
