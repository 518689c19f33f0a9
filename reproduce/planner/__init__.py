"""The what-if (``retrywatch reproduce whatif``): one workload under each named proxy policy and
each one's headroom (``whatif``), its command (``cli``) and its report (``report``)."""
