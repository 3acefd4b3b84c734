"""The OpenAI Realtime API over WebSocket (/v1/realtime) and the voice-chat page at /."""
