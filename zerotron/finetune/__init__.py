"""Fine-tuning: supervised data (chat formats, loss masks); adapters live in models/lora.py."""
