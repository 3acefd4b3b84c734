// Microphone capture: the AudioContext runs at 24 kHz, so its input frames are already at the
// rate the server wants; this converts them to pcm16 and posts ~100 ms chunks (and a level).
class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.chunk = new Int16Array(2400);
    this.filled = 0;
    this.peak = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    for (let i = 0; i < channel.length; i++) {
      const s = Math.max(-1, Math.min(1, channel[i]));
      this.peak = Math.max(this.peak, Math.abs(s));
      this.chunk[this.filled++] = s < 0 ? s * 0x8000 : s * 0x7fff;
      if (this.filled === this.chunk.length) {
        this.port.postMessage({ pcm: this.chunk.buffer, level: this.peak }, [this.chunk.buffer]);
        this.chunk = new Int16Array(2400);
        this.filled = 0;
        this.peak = 0;
      }
    }
    return true;
  }
}

registerProcessor("capture-processor", CaptureProcessor);
