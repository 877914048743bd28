"""No silent failure: progress, the watchdog, deadlines on plugin code, and the note a rank leaves when
it exits."""
