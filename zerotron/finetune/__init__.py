"""Fine-tuning: ``zerotron sft`` (supervised fine-tuning composed from the training loop); the data and adapters it uses live below the applications (zerotron.components)."""
