//! `corral setting ls | get | set`.

use clap::Subcommand;
use corral_daemon::output::{print, table};

use super::views::{SettingValue, SettingView};
use crate::client::Client;

#[derive(Subcommand, Debug)]
pub enum SettingCmd {
    /// List the settings with their values, defaults and descriptions.
    Ls,
    /// Show one setting.
    Get { name: String },
    /// Change a setting (the value is checked against the setting's type).
    Set { name: String, value: String },
}

pub async fn run(c: &Client, json: bool, cmd: SettingCmd) -> anyhow::Result<()> {
    match cmd {
        SettingCmd::Ls => {
            let ss: Vec<SettingView> = c.get("/v1/settings").await?;
            print(json, &ss, || {
                table(
                    &["SETTING", "VALUE", "DEFAULT", "DESCRIPTION"],
                    ss.iter()
                        .map(|s| {
                            vec![
                                s.name.clone(),
                                s.value.clone(),
                                s.default.clone(),
                                s.description.clone(),
                            ]
                        })
                        .collect(),
                )
                .to_string()
            })?;
        }
        SettingCmd::Get { name } => {
            let s: SettingView = c.get(&format!("/v1/settings/{name}")).await?;
            print(json, &s, || s.value.clone())?;
        }
        SettingCmd::Set { name, value } => {
            let s: SettingView = c
                .put(&format!("/v1/settings/{name}"), &SettingValue { value })
                .await?;
            print(json, &s, || format!("{} = {}", s.name, s.value))?;
        }
    }
    Ok(())
}
