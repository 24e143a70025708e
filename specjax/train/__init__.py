"""Training drafter heads: self-distillation data (`data`), the generic loop (`loop`), one file per head (`mtp`)."""
