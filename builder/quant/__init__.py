"""Weight quantization: algorithms (torch, on the checkpoint's linear layers) and calibration."""
