//! What a source's bytes must hash to (a DataVolume's `checksum: "sha256:…"`), checked on the
//! bytes as downloaded, before decompression, as CDI checks them.

use std::io::Read;

use sha2::Digest;

use crate::{ImportError, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checksum {
    algorithm: Algorithm,
    expected: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Algorithm {
    Sha256,
    Sha512,
}

impl Checksum {
    /// `ALGO:HEX`, ALGO `sha256` or `sha512`.
    pub fn parse(s: &str) -> Result<Checksum> {
        let bad = |why: String| Err(ImportError::Format(format!("checksum {s:?}: {why}")));
        let Some((algo, hex)) = s.split_once(':') else {
            return bad("expected ALGORITHM:HEX, e.g. sha256:…".into());
        };
        let (algorithm, len) = match algo {
            "sha256" => (Algorithm::Sha256, 32),
            "sha512" => (Algorithm::Sha512, 64),
            other => return bad(format!("algorithm {other:?} (accepted: sha256, sha512)")),
        };
        match hex::decode(hex) {
            Ok(expected) if expected.len() == len => Ok(Checksum {
                algorithm,
                expected,
            }),
            _ => bad(format!("{algo} takes {} hexadecimal digits", len * 2)),
        }
    }

    /// `r`, hashed as it is read.
    pub fn reader<R: Read>(&self, r: R) -> Digesting<R> {
        Digesting {
            inner: r,
            hasher: match self.algorithm {
                Algorithm::Sha256 => Hasher::Sha256(sha2::Sha256::new()),
                Algorithm::Sha512 => Hasher::Sha512(sha2::Sha512::new()),
            },
            expected: self.expected.clone(),
        }
    }
}

enum Hasher {
    Sha256(sha2::Sha256),
    Sha512(sha2::Sha512),
}

pub struct Digesting<R> {
    inner: R,
    hasher: Hasher,
    expected: Vec<u8>,
}

impl<R> Digesting<R> {
    /// Whether what was read hashes to the expected value.
    pub fn verify(self) -> Result<()> {
        let got = match self.hasher {
            Hasher::Sha256(h) => h.finalize().to_vec(),
            Hasher::Sha512(h) => h.finalize().to_vec(),
        };
        if got == self.expected {
            Ok(())
        } else {
            Err(ImportError::Checksum {
                expected: hex::encode(&self.expected),
                got: hex::encode(got),
            })
        }
    }
}

impl<R: Read> Read for Digesting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        match &mut self.hasher {
            Hasher::Sha256(h) => h.update(&buf[..n]),
            Hasher::Sha512(h) => h.update(&buf[..n]),
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_parse_and_verify() {
        let c = Checksum::parse(
            "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
        )
        .unwrap();
        let mut r = c.reader(&b"hello"[..]);
        std::io::copy(&mut r, &mut std::io::sink()).unwrap();
        r.verify().unwrap();
        let mut r = c.reader(&b"hellO"[..]);
        std::io::copy(&mut r, &mut std::io::sink()).unwrap();
        assert!(r
            .verify()
            .unwrap_err()
            .to_string()
            .contains("checksum mismatch"));
        for bad in ["sha256", "md5:00", "sha256:zz", "sha512:00"] {
            assert!(Checksum::parse(bad).is_err(), "{bad}");
        }
    }
}
