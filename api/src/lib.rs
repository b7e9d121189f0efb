//! kubevirt.io/v1 API types and the launcher control protocol (filled by the launcher issue).
