//! Reading a VirtualMachine or VirtualMachineInstance manifest: kind and apiVersion checks,
//! YAML errors with line and column, then KubeVirt defaulting and validation.

use api::validation::{default_vm, default_vmi_spec, validate_vm, validate_vmi, ValidationError};
use api::{VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceSpec};

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("{path}: YAML syntax error at line {line}, column {column}: {msg}")]
    Syntax {
        path: String,
        line: usize,
        column: usize,
        msg: String,
    },
    #[error("{path}: {msg}")]
    Schema { path: String, msg: String },
    #[error("{path}: apiVersion {api_version:?} kind {kind:?} is not accepted; accepted: apiVersion kubevirt.io/v1 with kind VirtualMachine or VirtualMachineInstance")]
    UnknownKind {
        path: String,
        api_version: String,
        kind: String,
    },
    #[error("{path}: {0}", path = .1)]
    Invalid(ValidationError, String),
    #[error("{path}: {err}")]
    Io { path: String, err: std::io::Error },
}

/// A manifest the launcher can run.
#[derive(Clone, Debug)]
pub enum Manifest {
    VirtualMachine(Box<VirtualMachine>),
    VirtualMachineInstance(Box<VirtualMachineInstance>),
}

impl Manifest {
    pub fn name(&self) -> String {
        let meta = match self {
            Manifest::VirtualMachine(vm) => &vm.metadata,
            Manifest::VirtualMachineInstance(vmi) => &vmi.metadata,
        };
        meta.name.clone().unwrap_or_else(|| "vm".into())
    }

    /// The VMI spec to run: the VM's template, or the VMI's own spec.
    pub fn vmi_spec(&self) -> &VirtualMachineInstanceSpec {
        match self {
            Manifest::VirtualMachine(vm) => vm.spec.template.spec.as_ref().expect("validated"),
            Manifest::VirtualMachineInstance(vmi) => &vmi.spec,
        }
    }
}

fn location(e: &serde_yaml::Error) -> (usize, usize) {
    e.location().map_or((0, 0), |l| (l.line(), l.column()))
}

/// Parses, defaults and validates.
pub fn parse(path: &str, text: &str) -> Result<Manifest, ManifestError> {
    let value: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| {
        let (line, column) = location(&e);
        ManifestError::Syntax {
            path: path.into(),
            line,
            column,
            msg: strip_location(&e.to_string()),
        }
    })?;
    let field = |k: &str| {
        value
            .get(k)
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string()
    };
    let (api_version, kind) = (field("apiVersion"), field("kind"));
    let schema = |e: serde_yaml::Error| ManifestError::Schema {
        path: path.into(),
        msg: e.to_string(),
    };
    match (api_version.as_str(), kind.as_str()) {
        ("kubevirt.io/v1", "VirtualMachine") => {
            let mut vm: VirtualMachine = serde_yaml::from_str(text).map_err(schema)?;
            default_vm(&mut vm);
            validate_vm(&vm).map_err(|e| ManifestError::Invalid(e, path.into()))?;
            Ok(Manifest::VirtualMachine(Box::new(vm)))
        }
        ("kubevirt.io/v1", "VirtualMachineInstance") => {
            let mut vmi: VirtualMachineInstance = serde_yaml::from_str(text).map_err(schema)?;
            default_vmi_spec(&mut vmi.spec);
            validate_vmi(&vmi).map_err(|e| ManifestError::Invalid(e, path.into()))?;
            Ok(Manifest::VirtualMachineInstance(Box::new(vmi)))
        }
        _ => Err(ManifestError::UnknownKind {
            path: path.into(),
            api_version,
            kind,
        }),
    }
}

pub fn read(path: &str) -> Result<Manifest, ManifestError> {
    let text = std::fs::read_to_string(path).map_err(|err| ManifestError::Io {
        path: path.into(),
        err,
    })?;
    parse(path, &text)
}

/// serde_yaml writes " at line L column C" into its messages; the error already says where.
fn strip_location(msg: &str) -> String {
    let mut out = msg.to_string();
    while let Some(i) = out.find(" at line ") {
        let rest = &out[i + " at line ".len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == ' ' || c.is_ascii_alphabetic()))
            .unwrap_or(rest.len());
        out = format!("{}{}", &out[..i], &rest[end..]);
    }
    out
}
