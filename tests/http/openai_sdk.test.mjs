// The official `openai` npm package (pinned in package-lock.json) against a running skyreels-server's /v1/videos.
// Started by tests/test_http.cpp, which checks the files this writes into $SKYREELS_OUT:
//   plain.mp4, reference.mp4: the downloaded videos; ids.json: the ids of the videos made here.
//   SKYREELS_HTTP_URL=http://127.0.0.1:PORT SKYREELS_API_KEY=KEY SKYREELS_OUT=DIR node openai_sdk.test.mjs
import assert from 'node:assert/strict';
import { File } from 'node:buffer';
import { writeFileSync } from 'node:fs';
import { deflateSync } from 'node:zlib';
import OpenAI, { toFile } from 'openai';

// Node.js 18 (Debian 12's) has `File` in node:buffer only; the SDK's toFile() wants the global (Node 20 has it).
globalThis.File ??= File;

const base = process.env.SKYREELS_HTTP_URL;
const out = process.env.SKYREELS_OUT;
const client = new OpenAI({ apiKey: process.env.SKYREELS_API_KEY, baseURL: `${base}/v1`, maxRetries: 0, timeout: 60000 });

// The tiny demo model: 48x32, 2 s at 8 fps = 17 frames (4k+1), 2 denoising steps; SDK extra fields by their names.
const shape = { size: '48x32', seconds: '2', fps: 8, num_inference_steps: 2 };
const prompt = 'A cat walks on the grass, realistic style.';

async function refusal(promise) {
  try {
    await promise;
  } catch (e) {
    return e;
  }
  assert.fail('the call succeeded');
}

async function finished(id) {
  const until = Date.now() + 120000;
  for (;;) {
    const video = await client.videos.retrieve(id);
    if (video.status === 'completed' || video.status === 'failed') return video;
    assert.ok(Date.now() < until, `video ${id} still ${video.status}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

// A 48x32 RGB PNG (a gradient), made here so the test needs no image library.
function png(width, height) {
  const crcTable = Array.from({ length: 256 }, (_, n) => {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    return c >>> 0;
  });
  const crc = (buf) => {
    let c = 0xffffffff;
    for (const b of buf) c = crcTable[(c ^ b) & 0xff] ^ (c >>> 8);
    return (c ^ 0xffffffff) >>> 0;
  };
  const chunk = (type, data) => {
    const length = Buffer.alloc(4);
    length.writeUInt32BE(data.length);
    const body = Buffer.concat([Buffer.from(type, 'ascii'), data]);
    const sum = Buffer.alloc(4);
    sum.writeUInt32BE(crc(body));
    return Buffer.concat([length, body, sum]);
  };
  const header = Buffer.alloc(13);
  header.writeUInt32BE(width, 0);
  header.writeUInt32BE(height, 4);
  header.set([8, 2, 0, 0, 0], 8);
  const rows = [];
  for (let y = 0; y < height; y++) {
    const row = Buffer.alloc(1 + 3 * width);
    for (let x = 0; x < width; x++) row.set([(x * 5) & 255, (y * 7) & 255, 128], 1 + 3 * x);
    rows.push(row);
  }
  return Buffer.concat([
    Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]),
    chunk('IHDR', header),
    chunk('IDAT', deflateSync(Buffer.concat(rows))),
    chunk('IEND', Buffer.alloc(0)),
  ]);
}

// Typed errors: an unknown key, a size the model cannot make, a video that does not exist.
const stranger = new OpenAI({ apiKey: 'not-a-key-of-this-server-0123456789', baseURL: `${base}/v1`, maxRetries: 0 });
const unauthenticated = await refusal(stranger.videos.list());
assert.ok(unauthenticated instanceof OpenAI.AuthenticationError, String(unauthenticated));
const badSize = await refusal(client.videos.create({ prompt, ...shape, size: '50x30' }));
assert.ok(badSize instanceof OpenAI.BadRequestError, String(badSize));
assert.equal(badSize.param, 'size');
const badSeconds = await refusal(client.videos.create({ prompt, ...shape, seconds: 'forever' }));
assert.ok(badSeconds instanceof OpenAI.BadRequestError, String(badSeconds));
assert.equal(badSeconds.param, 'seconds');
const missing = await refusal(client.videos.retrieve('no-such-video'));
assert.ok(missing instanceof OpenAI.NotFoundError, String(missing));

// Text to video, followed to the end, downloaded whole and by range.
const created = await client.videos.create({ prompt, ...shape, seed: 7 });
assert.equal(created.object, 'video');
assert.ok(['queued', 'in_progress'].includes(created.status), created.status);
const plain = await finished(created.id);
assert.equal(plain.status, 'completed', JSON.stringify(plain.error));
assert.equal(plain.progress, 100);
assert.equal(plain.seconds, '2');
assert.equal(plain.size, '48x32');
assert.equal(plain.prompt, prompt);
assert.ok(plain.completed_at >= plain.created_at && plain.expires_at > plain.completed_at);
const mp4 = Buffer.from(await (await client.videos.downloadContent(plain.id)).arrayBuffer());
writeFileSync(`${out}/plain.mp4`, mp4);
const thumbnail = await client.videos.downloadContent(plain.id, { variant: 'thumbnail' });
assert.equal(thumbnail.headers.get('content-type'), 'image/png');
writeFileSync(`${out}/thumbnail.png`, Buffer.from(await thumbnail.arrayBuffer()));
const ranged = await fetch(`${base}/v1/videos/${plain.id}/content`, {
  headers: { Authorization: `Bearer ${process.env.SKYREELS_API_KEY}`, Range: 'bytes=10-109' },
});
assert.equal(ranged.status, 206);
assert.equal(ranged.headers.get('content-range'), `bytes 10-109/${mp4.length}`);
assert.deepEqual(Buffer.from(await ranged.arrayBuffer()), mp4.subarray(10, 110));

// The same Idempotency-Key header twice: one video (the OpenAI client sends none of its own).
const again = await client.videos.create({ prompt, ...shape, seed: 7 }, { headers: { 'Idempotency-Key': 'same-request-twice' } });
const twice = await client.videos.create({ prompt, ...shape, seed: 7 }, { headers: { 'Idempotency-Key': 'same-request-twice' } });
assert.equal(again.id, twice.id);

// Image to video: an uploaded file, and the same image as a data URL.
const image = png(48, 32);
const withFile = await client.videos.create({
  prompt, ...shape, seed: 8, input_reference: await toFile(image, 'first.png', { type: 'image/png' }),
});
const reference = await finished(withFile.id);
assert.equal(reference.status, 'completed', JSON.stringify(reference.error));
writeFileSync(`${out}/reference.mp4`, Buffer.from(await (await client.videos.downloadContent(reference.id)).arrayBuffer()));
const withUrl = await client.videos.create({
  prompt, ...shape, seed: 8, input_reference: { image_url: `data:image/png;base64,${image.toString('base64')}` },
});
assert.equal((await finished(withUrl.id)).status, 'completed');

// Extensions (video-to-video): of a finished video by id, and of an uploaded MP4; 2 s more after the last 9 frames.
const byId = await client.videos.extend({ prompt, video: { id: plain.id }, seconds: '2', overlap_history: 9, num_inference_steps: 2 });
const extendedById = await finished(byId.id);
assert.equal(extendedById.status, 'completed', JSON.stringify(extendedById.error));
assert.equal(extendedById.skyreels.params.num_frames, '25');
writeFileSync(`${out}/extended.mp4`, Buffer.from(await (await client.videos.downloadContent(byId.id)).arrayBuffer()));
const byUpload = await client.videos.extend({
  prompt, video: await toFile(mp4, 'source.mp4', { type: 'video/mp4' }), seconds: '2', fps: 8, overlap_history: 9, num_inference_steps: 2,
});
const extendedUpload = await finished(byUpload.id);
assert.equal(extendedUpload.status, 'completed', JSON.stringify(extendedUpload.error));
assert.equal(extendedUpload.size, '48x32');

// Two long videos, the second waiting behind the first (one replica).
const ahead = await client.videos.create({ prompt, ...shape, num_inference_steps: 100 });
const long = await client.videos.create({ prompt, ...shape, num_inference_steps: 100 });

// Cursor pagination, one video per page, newest first.
const seen = [];
for await (const video of client.videos.list({ limit: 1 })) seen.push(video.id);
const made = [created.id, again.id, withFile.id, withUrl.id, ahead.id, long.id];
for (const id of made) assert.ok(seen.includes(id), `list misses ${id}`);
assert.equal(new Set(seen).size, seen.length, 'a video listed twice');
assert.equal(seen[0], long.id);
const firstPage = await client.videos.list({ limit: 2, order: 'asc' });
assert.equal(firstPage.data.length, 2);
assert.equal(firstPage.has_more, true);

// Deleted while it waits behind a long one (one replica): cancelled and gone; the running one is deleted too.
const deleted = await client.videos.delete(long.id);
assert.deepEqual(deleted, { id: long.id, object: 'video.deleted', deleted: true });
const gone = await refusal(client.videos.retrieve(long.id));
assert.ok(gone instanceof OpenAI.NotFoundError, String(gone));
await client.videos.delete(ahead.id);
for (let i = 0; ; i++) {  // its chunk stops at the next step; then it is dropped
  try {
    await client.videos.retrieve(ahead.id);
  } catch (e) {
    if (e instanceof OpenAI.NotFoundError) break;
    throw e;
  }
  assert.ok(i < 200, 'the running video was not deleted');
  await new Promise((r) => setTimeout(r, 100));
}

writeFileSync(`${out}/ids.json`, JSON.stringify({ plain: plain.id, reference: reference.id }));
console.log('openai sdk: all checks passed');
