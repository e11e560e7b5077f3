"""The checked replay: the plan compiled into columns and followed op by op, every op
checked."""
