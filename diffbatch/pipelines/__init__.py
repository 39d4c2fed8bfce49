"""diffbatch.pipelines."""
