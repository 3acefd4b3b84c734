// omnistage voice chat: the OpenAI Realtime protocol over /v1/realtime, microphone capture
// through an AudioWorklet (pcm16 at 24 kHz), gapless playback of the answer's audio deltas,
// interruption by speaking (server VAD in hands-free mode, the talk button in push-to-talk).
"use strict";

const RATE = 24000;
const $ = (id) => document.getElementById(id);
// what happened, for people debugging and for the browser test
const stats = (window.omnistage = {
  connected: false, sentChunks: 0, sentBytes: 0, audioDeltas: 0, audioBytes: 0, scheduled: 0,
  transcript: "", responses: 0, done: [], truncated: 0, errors: [], userTurns: 0,
});

let ws = null, ctx = null, micStream = null, model = null, mode = "ptt";
let talking = false, recording = [], responseActive = false, startedAt = 0;
let bubble = null; // the assistant's live bubble
let playing = null; // {itemId, parts: [{src, start, dur}]}
let playHead = 0;
const userBubbles = new Map(); // user item id -> its bubble (for the input transcription)

function setStatus(text, state) {
  $("status").textContent = text;
  $("status").dataset.state = state;
}

function headers() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) throw new Error(`/v1/models: HTTP ${r.status}`);
    const card = (await r.json()).data[0];
    model = card.id;
    const select = $("voice");
    select.innerHTML = "";
    for (const v of card.voices || []) select.add(new Option(v, v));
    if (!(card.voices || []).length) select.add(new Option("(text only)", ""));
  } catch (e) {
    showError(`Cannot list the model: ${e.message}`);
  }
}

// ------------------------------------------------------------------ chat bubbles
function addBubble(role, text = "") {
  $("empty")?.remove();
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.textContent = text;
  $("chat").appendChild(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function showError(message) {
  stats.errors.push(message);
  addBubble("error", message);
}

function wavUrl(chunks) {
  const n = chunks.reduce((a, c) => a + c.length, 0);
  const buf = new ArrayBuffer(44 + 2 * n);
  const v = new DataView(buf);
  const str = (o, s) => [...s].forEach((c, i) => v.setUint8(o + i, c.charCodeAt(0)));
  str(0, "RIFF"); v.setUint32(4, 36 + 2 * n, true); str(8, "WAVEfmt ");
  v.setUint32(16, 16, true); v.setUint16(20, 1, true); v.setUint16(22, 1, true);
  v.setUint32(24, RATE, true); v.setUint32(28, 2 * RATE, true); v.setUint16(32, 2, true);
  v.setUint16(34, 16, true); str(36, "data"); v.setUint32(40, 2 * n, true);
  let o = 44;
  for (const c of chunks) for (const s of c) { v.setInt16(o, s, true); o += 2; }
  return URL.createObjectURL(new Blob([buf], { type: "audio/wav" }));
}

function addUserTurn(chunks, itemId) {
  const samples = chunks.reduce((a, c) => a + c.length, 0);
  const el = addBubble("user");
  if (itemId) userBubbles.set(itemId, el);
  const audio = document.createElement("audio");
  audio.controls = true;
  audio.src = wavUrl(chunks);
  el.appendChild(audio);
  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = `You · ${(samples / RATE).toFixed(1)} s`;
  el.appendChild(meta);
  stats.userTurns++;
}

// ------------------------------------------------------------------ socket
function send(event) {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(event));
}

function b64(int16) {
  const bytes = new Uint8Array(int16.buffer, int16.byteOffset, int16.byteLength);
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(s);
}

function sessionUpdate() {
  const session = {
    audio: {
      input: {
        turn_detection: mode === "free" ? {
          type: "server_vad", threshold: 0.5, silence_duration_ms: 600, prefix_padding_ms: 300,
        } : null,
      },
      output: { voice: $("voice").value || null },
    },
    // the user's words under their audio: the model transcribes each turn (or not: null)
    output_modalities: $("voice").value ? ["audio"] : ["text"],
  };
  session.audio.input.transcription = $("transcribe").checked ? { model } : null;
  const instructions = $("instructions").value.trim();
  if (instructions) session.instructions = instructions;
  send({ type: "session.update", session });
}

function connect() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const protocols = ["realtime"];
  const key = $("api-key").value.trim();
  if (key) protocols.push(`openai-insecure-api-key.${key}`);
  ws = new WebSocket(`${scheme}://${location.host}/v1/realtime?model=${encodeURIComponent(model)}`,
                     protocols);
  ws.onopen = () => sessionUpdate();
  ws.onmessage = (m) => onEvent(JSON.parse(m.data));
  ws.onclose = (e) => {
    stats.connected = false;
    setStatus(e.code === 1000 || e.code === 1005 ? "Disconnected" :
              `Disconnected (${e.reason || e.code})`, e.code === 1000 ? "idle" : "error");
    setRunning(false);
  };
}

function onEvent(ev) {
  switch (ev.type) {
    case "session.created":
    case "session.updated":
      stats.connected = true;
      setStatus(mode === "free" ? "Listening" : "Connected", mode === "free" ? "listening" :
                "connected");
      break;
    case "input_audio_buffer.speech_started":
      interrupt(false); // the server cancels the answer (interrupt_response); stop playing it
      setStatus("Hearing you", "listening");
      break;
    case "input_audio_buffer.committed":
      if (recording.length) addUserTurn(recording, ev.item_id);
      recording = [];
      break;
    case "response.created":
      responseActive = true;
      stats.responses++;
      break;
    case "response.output_item.added":
      bubble = addBubble("assistant");
      bubble.classList.add("live");
      bubble.dataset.itemId = ev.item.id;
      playing = { itemId: ev.item.id, parts: [] };
      break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      stats.transcript += ev.delta;
      if (bubble) {
        bubble.textContent += ev.delta;
        bubble.scrollIntoView({ block: "end" });
      }
      break;
    case "response.output_audio.delta":
      play(ev);
      break;
    case "response.output_audio_transcript.done":
      // an interrupted answer's transcript ends where its audio was cut
      if (bubble) bubble.textContent = ev.transcript;
      break;
    case "response.done": {
      responseActive = false;
      stats.done.push(ev.response.status);
      if (bubble) {
        bubble.classList.remove("live");
        if (ev.response.status === "cancelled") bubble.classList.add("cut");
      }
      bubble = null;
      setStatus(mode === "free" ? "Listening" : "Connected", mode === "free" ? "listening" :
                "connected");
      break;
    }
    case "conversation.item.input_audio_transcription.delta":
    case "conversation.item.input_audio_transcription.completed": {
      const el = userBubbles.get(ev.item_id);
      if (!el) break;
      let said = el.querySelector(".said");
      if (!said) {
        said = document.createElement("p");
        said.className = "said";
        el.insertBefore(said, el.firstChild);
      }
      said.textContent = ev.type.endsWith("completed") ? ev.transcript
        : said.textContent + ev.delta;
      break;
    }
    case "conversation.item.truncated":
      stats.truncated++;
      break;
    case "error":
      showError(ev.error.message);
      break;
  }
}

// ------------------------------------------------------------------ playback
function play(ev) {
  const raw = atob(ev.delta);
  const pcm = new Int16Array(raw.length >> 1);
  for (let i = 0; i < pcm.length; i++) {
    pcm[i] = raw.charCodeAt(2 * i) | (raw.charCodeAt(2 * i + 1) << 8);
  }
  stats.audioDeltas++;
  stats.audioBytes += raw.length;
  if (!pcm.length || !playing || playing.itemId !== ev.item_id) return;
  const buf = ctx.createBuffer(1, pcm.length, RATE);
  const data = buf.getChannelData(0);
  for (let i = 0; i < pcm.length; i++) data[i] = pcm[i] / 32768;
  const src = ctx.createBufferSource();
  src.buffer = buf;
  src.connect(ctx.destination);
  // gapless: each chunk starts where the previous one ends (a little ahead at the start)
  const start = Math.max(playHead, ctx.currentTime + 0.05);
  src.start(start);
  playHead = start + buf.duration;
  playing.parts.push({ src, start, dur: buf.duration });
  stats.scheduled++;
  setStatus("Speaking", "speaking");
}

function playedMs() {
  const now = ctx.currentTime;
  let s = 0;
  for (const p of playing.parts) s += Math.min(Math.max(now - p.start, 0), p.dur);
  return Math.floor(s * 1000);
}

// Stop the answer being played; tell the server how much was heard (it cuts the transcript).
function interrupt(cancel) {
  if (cancel && responseActive) send({ type: "response.cancel" });
  if (!playing || !playing.parts.length) return;
  const stillPlaying = playHead > ctx.currentTime;
  if (stillPlaying) {
    send({ type: "conversation.item.truncate", item_id: playing.itemId, content_index: 0,
           audio_end_ms: playedMs() });
  }
  for (const p of playing.parts) {
    try { p.src.stop(); } catch (e) { /* already ended */ }
  }
  playing = { itemId: playing.itemId, parts: [] };
  playHead = ctx.currentTime;
}

// ------------------------------------------------------------------ microphone
function onChunk({ pcm, level }) {
  $("level").style.width = `${Math.min(100, level * 140)}%`;
  const chunk = new Int16Array(pcm);
  if (mode === "free" || talking) {
    send({ type: "input_audio_buffer.append", audio: b64(chunk) });
    stats.sentChunks++;
    stats.sentBytes += chunk.byteLength;
    recording.push(chunk);
    if (mode === "free" && recording.length > 600) recording.splice(0, 300); // (bounded)
  }
}

function talkStart() {
  if (mode !== "ptt" || talking || !stats.connected) return;
  interrupt(true);
  talking = true;
  recording = [];
  $("talk").classList.add("active");
  setStatus("Listening", "listening");
}

function talkEnd() {
  if (!talking) return;
  talking = false;
  $("talk").classList.remove("active");
  const samples = recording.reduce((a, c) => a + c.length, 0);
  if (samples < RATE / 10) { // under 100 ms: nothing to say
    send({ type: "input_audio_buffer.clear" });
    recording = [];
    return;
  }
  send({ type: "input_audio_buffer.commit" });
  send({ type: "response.create" });
}

async function start() {
  $("start").disabled = true;
  try {
    ctx = new AudioContext({ sampleRate: RATE });
    await ctx.audioWorklet.addModule("/static/capture-worklet.js");
    micStream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true,
               autoGainControl: true },
    });
    const node = new AudioWorkletNode(ctx, "capture-processor");
    node.port.onmessage = (e) => onChunk(e.data);
    ctx.createMediaStreamSource(micStream).connect(node);
    startedAt = performance.now();
    connect();
    setRunning(true);
  } catch (e) {
    showError(`Cannot start the microphone: ${e.message}`);
    $("start").disabled = false;
  }
}

function stop() {
  if (ws) ws.close(1000);
  if (micStream) micStream.getTracks().forEach((t) => t.stop());
  if (ctx) ctx.close();
  ws = ctx = micStream = null;
  setRunning(false);
}

function setRunning(on) {
  $("start").disabled = on;
  $("stop").disabled = !on;
  $("talk").disabled = !on || mode !== "ptt";
}

function setMode(next) {
  mode = next;
  $("mode-ptt").classList.toggle("on", mode === "ptt");
  $("mode-free").classList.toggle("on", mode === "free");
  $("mode-ptt").setAttribute("aria-checked", String(mode === "ptt"));
  $("mode-free").setAttribute("aria-checked", String(mode === "free"));
  $("talk-label").textContent = mode === "ptt" ? "Hold to talk" : "Just talk";
  $("talk").disabled = !ws || mode !== "ptt";
  recording = [];
  if (ws) sessionUpdate();
}

// ------------------------------------------------------------------ wiring
$("start").onclick = start;
$("stop").onclick = stop;
$("mode-ptt").onclick = () => setMode("ptt");
$("mode-free").onclick = () => setMode("free");
$("voice").onchange = () => ws && sessionUpdate();
$("transcribe").onchange = () => ws && sessionUpdate();
$("settings-toggle").onclick = () => {
  const s = $("settings");
  s.hidden = !s.hidden;
  $("settings-toggle").setAttribute("aria-expanded", String(!s.hidden));
};
$("api-key").onchange = loadModel;
$("talk").addEventListener("pointerdown", talkStart);
$("talk").addEventListener("pointerup", talkEnd);
$("talk").addEventListener("pointerleave", talkEnd);
document.addEventListener("keydown", (e) => {
  if (e.code === "Space" && e.target === document.body) { e.preventDefault(); talkStart(); }
});
document.addEventListener("keyup", (e) => {
  if (e.code === "Space" && e.target === document.body) { e.preventDefault(); talkEnd(); }
});
const params = new URLSearchParams(location.search);
if (params.get("mode") === "free") setMode("free");
loadModel();
